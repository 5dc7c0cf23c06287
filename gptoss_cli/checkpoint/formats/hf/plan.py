"""`ToHf`, the plan of `convert --to hf`: a Hybrid-named checkpoint (Hybrid, training, Megatron) re-laid out
for transformers through the mapping table, its experts bf16 or MXFP4 (`--experts`, a measured rounding
when the source was not trained in MXFP4: checkpoint/export_cost.py); written as safetensors shards
with config.json as the released models have it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Iterator

import torch

from gptoss_cli import outputs
from gptoss_cli.checkpoint.export_cost import RoundingMeter
from gptoss_cli.checkpoint.formats.hf.config import EXTRA_FILES, to_hf_config
from gptoss_cli.checkpoint.formats.hf.layouts import HF_LAYOUTS, UINT8, Layout
from gptoss_cli.checkpoint.formats.plan import (
    PROVENANCE_KEY, ConvertPlan, Empty, Job, cast, expert_chunk, fresh, row_ranges, streams_rows,
)
from gptoss_cli.checkpoint.formats.registry import Source
from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID, Unit, units
from gptoss_cli.checkpoint.storage.pipeline import RELEASE_HELD, Task
from gptoss_cli.checkpoint.storage.readers import RowReader
from gptoss_cli.checkpoint.storage.safetensors_io import TensorSpec
from gptoss_cli.errors import CheckpointError, UsageError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.dtypes import dtype_name
from gptoss_cli.model.mxfp4 import codec as mxfp4


def plan_to_hf(arch: GptOssArch, layout: Layout, dtype: torch.dtype) -> list[Job]:
    specs = layout.stored_specs(arch)
    jobs = []
    for u in units(arch):
        outs = []
        for canonical in u.hf:
            for name in layout.stored_names(canonical):
                shape, kind = specs[name]
                outs.append(TensorSpec(name, shape, torch.uint8 if kind == UINT8 else dtype))
        jobs.append(Job(u, outs))
    return jobs


def _read_hybrid(reader: RowReader, arch: GptOssArch, name: str, dtype: torch.dtype) -> torch.Tensor:
    if name in VOCAB_PADDED_HYBRID:  # strip Megatron's vocabulary padding
        return cast(reader.read(name, 0, arch.vocab_size), dtype)
    return cast(reader.read(name), dtype)


def _experts_to_hf(reader: RowReader, arch: GptOssArch, layout: Layout, unit: Unit, dtype: torch.dtype, e0: int, e1: int,
                   meter=None):
    per_expert = [_read_hybrid(reader, arch, name, dtype) for name in unit.hybrid[e0:e1]]
    if meter is not None and unit.hybrid[0].split(".")[-1].startswith("weight"):  # what MXFP4 will make of them
        for name, t in zip(unit.hybrid[e0:e1], per_expert):  # [out, in], rounded along `in` as stored
            meter.add(name, t, mxfp4.round_to_mxfp4(t))
    (chunk,) = unit.to_hf(arch, per_expert)
    try:
        stored = layout.store(unit.hf[0], chunk)
    except mxfp4.NonFiniteError as exc:
        raise CheckpointError(
            f"{unit.hybrid[e0 + exc.index[0]]}: holds {exc.value}; MXFP4 has no encoding for NaN or Inf"
        ) from None
    pieces = [(name, cast(t, dtype)) for name, t in stored]
    return pieces[:1], pieces[1:]  # MXFP4 scales are held: they follow all blocks (1/16 of their size)


def _unit_to_hf(reader: RowReader, arch: GptOssArch, layout: Layout, unit: Unit, dtype: torch.dtype):
    ins = [_read_hybrid(reader, arch, n, dtype) for n in unit.hybrid]
    out = []
    for canonical, t in zip(unit.hf, unit.to_hf(arch, ins)):
        out.extend((name, cast(piece, dtype)) for name, piece in layout.store(canonical, t))
    return out, []


def _tasks_to_hf(reader: RowReader, arch: GptOssArch, job: Job, dtype: torch.dtype, layout: Layout, budget: int,
                 meter=None):
    unit, out = job.unit, job.outputs[0]
    if streams_rows(unit, out) and len(job.outputs) == 1:
        for r0, r1 in row_ranges(out, budget):
            yield lambda r0=r0, r1=r1: ([(out.name, cast(reader.read(unit.hybrid[0], r0, r1), dtype))], [])
        return
    if unit.per_expert:
        n = expert_chunk(arch, unit, dtype, budget)
        for e0 in range(0, arch.num_local_experts, n):
            yield partial(_experts_to_hf, reader, arch, layout, unit, dtype, e0, min(arch.num_local_experts, e0 + n),
                          meter)
        yield RELEASE_HELD
        return
    yield partial(_unit_to_hf, reader, arch, layout, unit, dtype)


@dataclass
class ToHf(ConvertPlan):
    """A Hybrid-named checkpoint (Hybrid, training, Megatron) -> HF, its experts in `layout`'s form."""

    target: ClassVar[str] = "hf"
    extra_files: ClassVar[tuple[str, ...]] = EXTRA_FILES
    layout: Layout = HF_LAYOUTS["bf16"]
    meter: Any = None  # export_cost.RoundingMeter: MXFP4 experts the source was not trained with

    def tasks(self, reader: RowReader, job: Job, budget: int, empty: Empty = fresh) -> Iterator[Task | object]:
        return _tasks_to_hf(reader, self.source.arch, job, self.dtype, self.layout, budget, self.meter)

    def close_writer(self, writer, provenance: dict) -> None:
        writer.close(index_metadata={PROVENANCE_KEY: provenance})

    def write_files(self, folder: Path, provenance: dict) -> None:
        config = to_hf_config(self.source.arch, experts_form=self.experts_out, torch_dtype=dtype_name(self.dtype))
        outputs.write_text(folder / "config.json", json.dumps(config, indent=2) + "\n")


def to_hf_plan(source: Source, *, experts: str | None, dtype: torch.dtype) -> ToHf:
    arch = source.arch
    out_form = experts or "bf16"
    if out_form == "mxfp4" and (arch.hidden_size % 32 or arch.intermediate_size % 32):
        raise UsageError(
            f"--experts mxfp4 needs hidden_size and intermediate_size divisible by 32 "
            f"(got {arch.hidden_size}, {arch.intermediate_size})"
        )
    layout = HF_LAYOUTS[out_form]
    # Experts stored or trained in MXFP4 lose nothing more; any other experts are rounded: measured
    rounds = out_form == "mxfp4" and source.experts_form != "mxfp4" and source.provenance.get("qat") != "mxfp4"
    return ToHf(source, dtype, plan_to_hf(arch, layout, dtype), source.experts_form, out_form, layout=layout,
                meter=RoundingMeter() if rounds else None)


__all__ = ["ToHf", "to_hf_plan", "plan_to_hf"]
