"""The readers a training checkpoint is read through, each with the reader interface of CheckpointReader /
DcpReader over Hybrid names: a LoRA run's adapters merged into its base, an HF base under Hybrid names,
and a QAT run's experts rounded to MXFP4 as its forward computed (`merged_with_base` puts them together).

A LoRA training checkpoint read as merged weights is the frozen base's tensors plus scaling * B @ A:
`LoraMergedReader` serves the base's tensors, and for every adapted weight (`<layer>.weight`, or
`<layer>.weight{e}` of an expert) the base tensor plus its adapter's delta, in fp32 by
`model.lora.merged_weight` (the formula a QAT run's forward rounds; the caller casts once to its
output dtype, so the fine-tune is rounded once, not twice). Conversion, loading and parity read a
LoRA checkpoint through it as if it were a full one. `HfHybridView` serves an HF (or OpenAI
original) base under Hybrid names, so adapters trained on a released checkpoint merge by name too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gptoss_cli.checkpoint.formats.hf.layouts import Layout
from gptoss_cli.checkpoint.formats.registry import check_tensors
from gptoss_cli.checkpoint.formats.training.record import MASTER, MODEL, TRAIN_STATE, check_base, model_key, optimizer_key
from gptoss_cli.checkpoint.mapping import Unit, hybrid_shapes, identity, units
from gptoss_cli.checkpoint.storage.dcp_io import SpecReader
from gptoss_cli.checkpoint.storage.safetensors_io import TensorSpec
from gptoss_cli.errors import CheckpointError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.expert_names import expert_name, parse_expert_name
from gptoss_cli.model.lora import ADAPTER, LINEAR_IN, LINEAR_OUT, merged_weight
from gptoss_cli.model.mxfp4.codec import round_to_mxfp4


def adapter_names(name: str) -> tuple[str, str] | None:
    """(A's name, B's name) of the adapter of a Hybrid weight name, by the model's naming (model/lora.py)."""
    per_expert = parse_expert_name(name)
    stack = name if per_expert is None else per_expert.stack
    if not stack.endswith(".weight"):
        return None
    stem = f"{stack.removesuffix('.weight')}.{ADAPTER}"
    pair = f"{stem}.{LINEAR_IN}.weight", f"{stem}.{LINEAR_OUT}.weight"
    return pair if per_expert is None else tuple(expert_name(p, per_expert.expert) for p in pair)


class HfHybridView(SpecReader):
    """An HF or OpenAI-original checkpoint read under Hybrid names through the mapping table (mapping.py)
    and its stored layout (formats/hf/layouts.py), as `gptoss convert` to Hybrid computes them: a read computes its
    table unit (the fused QKV from q/k/v, one expert's fc1 de-interleaved from its gate_up stack, MXFP4
    decoded) and nothing more, so memory stays bounded by one tensor group. MXFP4 experts read as bf16,
    which holds every MXFP4 value exactly; other tensors keep their stored dtype."""

    concurrent_reads = False  # served by the one reader of the source

    def __init__(self, reader, layout: Layout, arch: GptOssArch):
        self.reader, self.layout, self.arch = reader, layout, arch
        self.folder = getattr(reader, "folder", None)
        self._units: dict[str, tuple[Unit, int]] = {}
        self._specs: dict[str, TensorSpec] = {}
        shapes = hybrid_shapes(arch)
        for unit in units(arch):
            stored = layout.stored_names(unit.hf[0])[0]
            dtype = torch.bfloat16 if reader.dtype(stored) == torch.uint8 else reader.dtype(stored)
            for i, name in enumerate(unit.hybrid):
                self._units[name] = unit, i
                self._specs[name] = TensorSpec(name, shapes[name], dtype)

    def close(self) -> None:
        self.reader.close()

    def file_of(self, name: str) -> Path:
        unit, _ = self._units[name]
        return self.reader.file_of(self.layout.stored_names(unit.hf[0])[0])

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        unit, i = self._units[name]
        dtype = self._specs[name].dtype
        if unit.per_expert:  # this expert's slice of the stack, then the table's transform
            (t,) = unit.to_hybrid(self.arch, [self.layout.read(self.reader, self.arch, unit.hf[0], dtype, i, i + 1)])
        elif unit.mapping.to_hybrid is identity:  # one tensor renamed: its rows read as asked
            return self.layout.read(self.reader, self.arch, unit.hf[0], dtype, start, stop)
        else:
            (t,) = unit.to_hybrid(self.arch, [self.layout.read(self.reader, self.arch, n, dtype) for n in unit.hf])
        return t if start is None and stop is None else t[start:stop].contiguous()


class LoraMergedReader:
    """Base tensors (Hybrid names, `base`) with the adapters of `adapters` merged in at `scaling`."""

    concurrent_reads = False  # the adapters come from a DcpReader, which serves one stream of reads

    def __init__(self, base, adapters, scaling: float):
        self.base, self.adapters, self.scaling = base, adapters, scaling
        self.folder = getattr(base, "folder", None)
        self.merged = 0  # adapted tensors read so far
        self._held: dict[str, torch.Tensor] | None = None

    def close(self) -> None:
        self.base.close()
        self.adapters.close()

    def names(self) -> list[str]:
        return self.base.names()

    def __contains__(self, name: str) -> bool:
        return name in self.base

    def spec(self, name: str) -> TensorSpec:
        return self.base.spec(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.base.dtype(name)

    def file_of(self, name: str) -> Path:
        return self.base.file_of(name)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        t = self.base.read(name, start, stop)
        pair = adapter_names(name)
        if pair is None or pair[0] not in self.adapters:
            return t
        if self._held is None:  # adapters are small (about 1% of the base): read them once, in order
            self._held = {n: self.adapters.read(n) for n in self.adapters.names()}
        a = self._held[pair[0]]
        b = self._held[pair[1]][start:stop]  # rows of the output = rows of B
        self.merged += 1
        return merged_weight(t, a, b, self.scaling)


def merged_with_base(run, folder: Path, adapters, open_source):
    """The base a LoRA run names (checked byte for byte), opened by `open_source` (sources.open_source, handed
    in: the rows sit below it) and read under Hybrid names (an HF or OpenAI-original base through
    `HfHybridView`) with the run's adapters merged in."""
    base_source = None
    try:
        check_base(run.lora["base"], folder / TRAIN_STATE)
        base_source = open_source(run.lora["base"]["path"])
        if not base_source.format.lora_base:
            raise CheckpointError(f"{folder}: its LoRA base {base_source.folder} is {base_source.format.title} "
                                  "checkpoint; the adapters merge into a Hybrid, HF or OpenAI-original base")
        base = base_source.reader
        if base_source.layout is not None:  # HF or original: Hybrid names through the mapping table
            check_tensors(base_source, base_source.layout.stored_specs(base_source.arch))
            base = HfHybridView(base, base_source.layout, base_source.arch)
    except BaseException:
        if base_source is not None:
            base_source.close()
        adapters.close()
        raise
    if run.lora.get("base_experts") == "mxfp4":  # the model stored the base's experts encoded: W is Q(W)
        base = Mxfp4QatReader(base)
    merged = LoraMergedReader(base, adapters, float(run.lora["alpha"]) / int(run.lora["rank"]))
    # QAT rounded the merged expert weights, W + scaling * B @ A, in the forward: so does the reader
    return Mxfp4QatReader(merged) if run.qat == "mxfp4" else merged


def _is_expert_weight(name: str) -> bool:
    """A per-expert weight under its Hybrid name: decoder.layers.<i>.mlp.experts.linear_fc<1|2>.weight<e>."""
    per_expert = parse_expert_name(name)
    return per_expert is not None and per_expert.is_base and per_expert.kind == "weight"


class Mxfp4QatReader:
    """A training checkpoint of a `precision.qat=mxfp4` run (or the base of a `lora.base_experts=mxfp4`
    run, which the model stored encoded), read as its forward computed: every expert
    weight rounded to MXFP4 along its input axis (`round_to_mxfp4`, the export's own codec), every
    other tensor as stored. Rows are rounded independently, so row-range reads round the same."""

    def __init__(self, reader):
        self._reader = reader

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        t = self._reader.read(name, start, stop)
        if not _is_expert_weight(name) or not t.is_floating_point() or not torch.isfinite(t).all():
            return t  # non-finite weights are left for the finite checks to name
        return round_to_mxfp4(t)



def check_group(reader, run, folder: Path, weights: str) -> None:
    """Every tensor the recorded architecture has is in the group `--weights` reads, at its shape: a
    checkpoint whose metadata lacks some (master copies a run never saved, a damaged `.metadata`) is one
    line naming the first, before anything is read or written."""
    from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID  # noqa: PLC0415

    key = model_key if weights == MODEL else (lambda n: optimizer_key(n, MASTER))
    try:
        names = set(reader.names())
        expected = hybrid_shapes(run.arch)
        missing = [n for n in expected if n not in names]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise CheckpointError(
                f"{folder}: its DCP metadata has no tensor {key(missing[0])!r}{more}, which the recorded architecture "
                f"needs (--weights {weights})",
                hint="the checkpoint is incomplete or damaged; use an earlier iter_* folder"
                + (", or --weights model" if weights == MASTER else ""))
        for name, shape in expected.items():
            stored = tuple(reader.shape(name))
            padded = name in VOCAB_PADDED_HYBRID and stored[1:] == shape[1:] and stored[0] >= shape[0]
            if stored != tuple(shape) and not padded:
                raise CheckpointError(f"{folder}: tensor {key(name)!r} has shape {list(stored)} in the DCP metadata, "
                                      f"the recorded architecture gives it {list(shape)}",
                                      hint="train_state.json's run record does not describe these tensors")
    except BaseException:
        reader.close()
        raise


__all__ = ["HfHybridView", "LoraMergedReader", "Mxfp4QatReader", "adapter_names", "check_group", "merged_with_base"]
