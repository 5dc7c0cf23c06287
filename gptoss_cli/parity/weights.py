"""Weight parity: every HF tensor maps to Hybrid tensors and back with identical values.

Both sides are read from their files on disk, unit by unit of the mapping table (experts in
chunks), so this is not an in-memory round trip and holds one tensor group at a time. A Hybrid
checkpoint stored in a lower precision than the HF one is compared against the HF values
rounded to that precision (what `convert --dtype` promises); everything else must be bit-equal.
"""

from __future__ import annotations

from typing import Callable

import torch

from gptoss_cli.checkpoint.formats.hf.layouts import EXPERT_CHUNK
from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID, Unit, units
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.parity.report import WeightReport


def _read_hybrid(reader, name: str, arch: GptOssArch) -> torch.Tensor:
    if name in VOCAB_PADDED_HYBRID and reader.shape(name)[0] > arch.vocab_size:
        return reader.read(name, 0, arch.vocab_size)  # Megatron's vocabulary padding (docs/checkpoint-layouts.md)
    return reader.read(name)


def _difference(expected: torch.Tensor, got: torch.Tensor) -> str | None:
    """None when equal (after rounding `expected` to got's dtype), else a short description."""
    if tuple(expected.shape) != tuple(got.shape):
        return f"shape {list(got.shape)}, expected {list(expected.shape)}"
    exp = expected.to(got.dtype)
    if torch.equal(exp, got):
        return None
    diff = (exp.double() - got.double()).abs()
    return f"max abs diff {diff.max().item():.3g} in {int((diff > 0).sum())} of {diff.numel()} values"


def _check_unit(report: WeightReport, unit: Unit, hf, hybrid_reader, arch: GptOssArch, lo: int, hi: int) -> None:
    names = unit.hybrid[lo:hi] if unit.per_expert else unit.hybrid
    if unit.per_expert:
        canon = [hf.layout.read(hf.reader, arch, unit.hf[0], torch.float32, lo, hi)]
    else:
        canon = [hf.layout.read(hf.reader, arch, n, torch.float32) for n in unit.hf]
    ours = [_read_hybrid(hybrid_reader, n, arch) for n in names]
    report.tensors_checked += len(names)
    shapes_ok = True
    for name, expected, got in zip(names, unit.to_hybrid(arch, canon), ours):
        problem = _difference(expected, got)
        if problem is not None:
            shapes_ok &= tuple(expected.shape) == tuple(got.shape)
            report.mismatches.append({"tensor": name, "block": unit.block, "direction": "hf->hybrid", "detail": problem})
    if not shapes_ok:
        return  # the way back cannot even be assembled
    back = unit.to_hf(arch, ours)
    for canonical, expected, got in zip(unit.hf, canon, back):
        if unit.per_expert:
            expected = expected.to(got.dtype)
        problem = _difference(expected, got)
        if problem is not None:
            report.mismatches.append(
                {"tensor": canonical, "block": unit.block, "direction": "hybrid->hf", "detail": problem}
            )


def check_weights(hf, hybrid_reader, arch: GptOssArch, progress: Callable[[str], None] | None = None) -> WeightReport:
    """`hf`: an opened HF Source (reader + layout); `hybrid_reader`: a CheckpointReader."""
    report = WeightReport()
    hf_names = set(hf.reader.names())
    hybrid_names = set(hybrid_reader.names())
    used_hf: set[str] = set()
    used_hybrid: set[str] = set()
    hybrid_float = {hybrid_reader.dtype(n) for n in hybrid_names if hybrid_reader.dtype(n).is_floating_point}
    hf_float = {hf.reader.dtype(n) for n in hf_names if hf.reader.dtype(n).is_floating_point}
    if hybrid_float and hf_float and max(t.itemsize for t in hybrid_float) < max(t.itemsize for t in hf_float):
        report.rounded_to = ",".join(sorted(str(t).removeprefix("torch.") for t in hybrid_float))
    for unit in units(arch):
        stored = [s for c in unit.hf for s in hf.layout.stored_names(c)]
        used_hf.update(stored)
        used_hybrid.update(unit.hybrid)
        missing_hf = [s for s in stored if s not in hf_names]
        missing_hybrid = [n for n in unit.hybrid if n not in hybrid_names]
        report.missing_hf += missing_hf
        report.missing_hybrid += missing_hybrid
        if missing_hf or missing_hybrid:
            continue
        if unit.per_expert:
            for lo in range(0, arch.num_local_experts, EXPERT_CHUNK):
                _check_unit(report, unit, hf, hybrid_reader, arch, lo, min(lo + EXPERT_CHUNK, arch.num_local_experts))
        else:
            _check_unit(report, unit, hf, hybrid_reader, arch, 0, 0)
        if progress is not None:
            progress(f"weights {unit.hybrid[0]}")
    report.leftover_hf = sorted(hf_names - used_hf)
    report.leftover_hybrid = sorted(n for n in hybrid_names - used_hybrid if not n.endswith("._extra_state"))
    return report
