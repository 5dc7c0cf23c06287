"""`ToHybrid`, the plan of `convert --to hybrid`: HF or OpenAI original decoded through its layout (the
mapping table's transforms), or a Hybrid-named source (training, Megatron) copied by name; written as
safetensors shards with hybrid_config.json. `ToMegatron` (formats/megatron/plan.py) computes the same."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import ClassVar, Iterator

import torch

from gptoss_cli.checkpoint.formats.hf.config import EXTRA_FILES
from gptoss_cli.checkpoint.formats.hf.layouts import Layout
from gptoss_cli.checkpoint.formats.hybrid.config import HybridCheckpointConfig, write_hybrid_config
from gptoss_cli.checkpoint.formats.plan import (
    ConvertPlan, Empty, Job, cast, expert_chunk, fresh, row_ranges, streams_rows,
)
from gptoss_cli.checkpoint.formats.registry import Source, check_tensors
from gptoss_cli.checkpoint.mapping import Unit, hybrid_shapes, units
from gptoss_cli.checkpoint.storage.pipeline import Task
from gptoss_cli.checkpoint.storage.readers import RowReader
from gptoss_cli.checkpoint.storage.safetensors_io import TensorSpec
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.dtypes import dtype_name


def plan_to_hybrid(arch: GptOssArch, dtype: torch.dtype) -> list[Job]:
    shapes = hybrid_shapes(arch)
    return [Job(u, [TensorSpec(n, shapes[n], dtype) for n in u.hybrid]) for u in units(arch)]


def _experts_to_hybrid(reader: RowReader, arch: GptOssArch, layout: Layout, job: Job, dtype: torch.dtype,
                       empty: Empty, e0: int, e1: int):
    unit = job.unit
    names = unit.hybrid[e0:e1]
    stored = layout.read_rowwise(reader, unit.hf[0], e0, e1)
    if stored is not None:  # MXFP4: de-interleave/unstack the bytes, then decode each expert into its output buffer
        moved = [unit.to_hybrid(arch, [t]) for t in stored]
        shape = job.outputs[0].shape  # every expert's
        return [(name, layout.load(unit.hf[0], list(parts), dtype, out=empty(name, 0, shape, dtype)))
                for name, parts in zip(names, zip(*moved))], []
    chunk = layout.read(reader, arch, unit.hf[0], dtype, e0, e1)
    return [(name, cast(t, dtype)) for name, t in zip(names, unit.to_hybrid(arch, [chunk]))], []


def _tasks_copy(reader: RowReader, job: Job, dtype: torch.dtype, budget: int):
    """Hybrid names in, the same names out (a training checkpoint becoming a Hybrid one), in row ranges."""
    for out in job.outputs:
        for r0, r1 in row_ranges(out, budget):
            yield lambda out=out, r0=r0, r1=r1: ([(out.name, cast(reader.read(out.name, r0, r1), dtype))], [])


def _unit_to_hybrid(reader: RowReader, arch: GptOssArch, layout: Layout, unit: Unit, dtype: torch.dtype):
    ins = [layout.read(reader, arch, n, dtype) for n in unit.hf]
    return [(name, cast(t, dtype)) for name, t in zip(unit.hybrid, unit.to_hybrid(arch, ins))], []


def _tasks_to_hybrid(reader: RowReader, arch: GptOssArch, layout: Layout, job: Job, dtype: torch.dtype, budget: int,
                     empty: Empty):
    unit, out = job.unit, job.outputs[0]
    if streams_rows(unit, out):
        for r0, r1 in row_ranges(out, budget):
            yield lambda r0=r0, r1=r1: ([(out.name, layout.read(reader, arch, unit.hf[0], dtype, r0, r1))], [])
        return
    if unit.per_expert:
        n = expert_chunk(arch, unit, dtype, budget)
        for e0 in range(0, arch.num_local_experts, n):
            yield partial(_experts_to_hybrid, reader, arch, layout, job, dtype, empty, e0, min(arch.num_local_experts, e0 + n))
        return
    yield partial(_unit_to_hybrid, reader, arch, layout, unit, dtype)


@dataclass
class ToHybrid(ConvertPlan):
    """HF or OpenAI original -> Hybrid (decoded through the source's layout), or a training or Megatron
    checkpoint -> Hybrid (copied by name, cast to the output dtype)."""

    target: ClassVar[str] = "hybrid"
    extra_files: ClassVar[tuple[str, ...]] = EXTRA_FILES

    @classmethod
    def for_source(cls, source: Source, dtype: torch.dtype, **kwargs) -> "ToHybrid":
        if source.layout is not None:
            check_tensors(source, source.layout.stored_specs(source.arch))
        return cls(source, dtype, plan_to_hybrid(source.arch, dtype), source.experts_form, **kwargs)

    def tasks(self, reader: RowReader, job: Job, budget: int, empty: Empty = fresh) -> Iterator[Task | object]:
        if self.source.format.hybrid_named:
            return _tasks_copy(reader, job, self.dtype, budget)
        return _tasks_to_hybrid(reader, self.source.arch, self.source.layout, job, self.dtype, budget, empty)

    def write_files(self, folder: Path, provenance: dict) -> None:
        arch = self.source.arch
        write_hybrid_config(folder, HybridCheckpointConfig(
            arch=arch, hybrid_layer_pattern=arch.hybrid_layer_pattern, dtype=dtype_name(self.dtype),
            provenance=provenance))


__all__ = ["ToHybrid", "plan_to_hybrid"]
