"""Conversion plans: one object per output layout, saying what a conversion reads, computes and writes.

`ConvertPlan` is what every plan answers; convert's `make_plan` checks a source and asks the target's
registry row (checkpoint/formats/) for its plan: `ToHybrid` here (HF or OpenAI original decoded
through its layout, or a training / Megatron checkpoint copied by Hybrid name), `ToHf` here (any
Hybrid-named source re-laid out for transformers, experts bf16 or MXFP4), `ToMegatron`
(checkpoint/megatron/plan.py) and `ToPeft` (checkpoint/peft_plan.py). `convert()` then runs any
plan the same way: its jobs, cut into tasks, through the thread pipeline into the plan's writer,
then the plan's folder files.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import torch

from gptoss_cli import outputs
from gptoss_cli.checkpoint.export_cost import RoundingMeter
from gptoss_cli.checkpoint.formats.registry import Source, check_tensors
from gptoss_cli.checkpoint.formats.hf.config import EXTRA_FILES, to_hf_config
from gptoss_cli.checkpoint.formats.hybrid.config import HybridCheckpointConfig, write_hybrid_config
from gptoss_cli.checkpoint.formats.hf.layouts import HF_LAYOUTS, UINT8, Layout
from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID, Unit, hybrid_shapes, identity, units
from gptoss_cli.checkpoint.storage.pipeline import RELEASE_HELD, Task
from gptoss_cli.checkpoint.storage.readers import RowReader
from gptoss_cli.checkpoint.storage.safetensors_io import ShardedWriter, TensorSpec
from gptoss_cli.errors import CheckpointError, UsageError
from gptoss_cli.model import mxfp4
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.dtypes import dtype_name

PROVENANCE_KEY = "gptoss_provenance"  # HF outputs: in the index's metadata (config.json stays as released)


# --- jobs: the output tensors of each table unit, in write order ---------------------------
@dataclass
class Job:
    """A bound table unit (or what else a plan cuts its work by) plus the output tensors it writes, in write order."""

    unit: Any  # a mapping-table Unit; ToPeft: an HF block index
    outputs: list[TensorSpec]


def _expert_chunk(arch: GptOssArch, unit: Unit, dtype: torch.dtype, budget: int) -> int:
    """How many experts fit in one chunk of `budget` bytes of transformed output."""
    per_expert = max(1, _canonical_numel_per_expert(arch, unit.hf[0]) * torch.empty((), dtype=dtype).element_size())
    return max(1, min(arch.num_local_experts, budget // per_expert))


def _canonical_numel_per_expert(arch: GptOssArch, name: str) -> int:
    H, I = arch.hidden_size, arch.intermediate_size
    if name.endswith("gate_up"):
        return 2 * I * H
    if name.endswith("down"):
        return H * I
    if name.endswith("gate_up_proj_bias"):
        return 2 * I
    return H


def plan_to_hybrid(arch: GptOssArch, dtype: torch.dtype) -> list[Job]:
    shapes = hybrid_shapes(arch)
    return [Job(u, [TensorSpec(n, shapes[n], dtype) for n in u.hybrid]) for u in units(arch)]


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


# --- tasks: how each direction computes a job's output pieces ----------------------------
# Where a task computes an output piece: (tensor name, first row, shape, dtype) -> a fresh tensor.
# The safetensors writer's `empty` places it for its O_DIRECT writes (no copy on the way out).
Empty = Callable[[str, int, tuple[int, ...], torch.dtype], torch.Tensor]


def fresh(name: str, row: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Any memory will do (a writer that copies anyway)."""
    return torch.empty(shape, dtype=dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def _read_hybrid(reader: RowReader, arch: GptOssArch, name: str, dtype: torch.dtype) -> torch.Tensor:
    if name in VOCAB_PADDED_HYBRID:  # strip Megatron's vocabulary padding
        return _cast(reader.read(name, 0, arch.vocab_size), dtype)
    return _cast(reader.read(name), dtype)


def _row_ranges(spec: TensorSpec, budget: int):
    """Row ranges of about `budget` bytes, so that a 1 GB embedding is never held whole."""
    step = max(1, budget // max(1, spec.row_bytes))
    rows = spec.shape[0] if spec.shape else 1
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _streams_rows(unit: Unit, spec: TensorSpec) -> bool:
    return unit.mapping.to_hybrid is identity and len(unit.hf) == 1 and len(spec.shape) >= 1


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
    return [(name, _cast(t, dtype)) for name, t in zip(names, unit.to_hybrid(arch, [chunk]))], []


def _tasks_copy(reader: RowReader, job: Job, dtype: torch.dtype, budget: int):
    """Hybrid names in, the same names out (a training checkpoint becoming a Hybrid one), in row ranges."""
    for out in job.outputs:
        for r0, r1 in _row_ranges(out, budget):
            yield lambda out=out, r0=r0, r1=r1: ([(out.name, _cast(reader.read(out.name, r0, r1), dtype))], [])


def _unit_to_hybrid(reader: RowReader, arch: GptOssArch, layout: Layout, unit: Unit, dtype: torch.dtype):
    ins = [layout.read(reader, arch, n, dtype) for n in unit.hf]
    return [(name, _cast(t, dtype)) for name, t in zip(unit.hybrid, unit.to_hybrid(arch, ins))], []


def _tasks_to_hybrid(reader: RowReader, arch: GptOssArch, layout: Layout, job: Job, dtype: torch.dtype, budget: int,
                     empty: Empty):
    unit, out = job.unit, job.outputs[0]
    if _streams_rows(unit, out):
        for r0, r1 in _row_ranges(out, budget):
            yield lambda r0=r0, r1=r1: ([(out.name, layout.read(reader, arch, unit.hf[0], dtype, r0, r1))], [])
        return
    if unit.per_expert:
        n = _expert_chunk(arch, unit, dtype, budget)
        for e0 in range(0, arch.num_local_experts, n):
            yield partial(_experts_to_hybrid, reader, arch, layout, job, dtype, empty, e0, min(arch.num_local_experts, e0 + n))
        return
    yield partial(_unit_to_hybrid, reader, arch, layout, unit, dtype)


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
    pieces = [(name, _cast(t, dtype)) for name, t in stored]
    return pieces[:1], pieces[1:]  # MXFP4 scales are held: they follow all blocks (1/16 of their size)


def _unit_to_hf(reader: RowReader, arch: GptOssArch, layout: Layout, unit: Unit, dtype: torch.dtype):
    ins = [_read_hybrid(reader, arch, n, dtype) for n in unit.hybrid]
    out = []
    for canonical, t in zip(unit.hf, unit.to_hf(arch, ins)):
        out.extend((name, _cast(piece, dtype)) for name, piece in layout.store(canonical, t))
    return out, []


def _tasks_to_hf(reader: RowReader, arch: GptOssArch, job: Job, dtype: torch.dtype, layout: Layout, budget: int,
                 meter=None):
    unit, out = job.unit, job.outputs[0]
    if _streams_rows(unit, out) and len(job.outputs) == 1:
        for r0, r1 in _row_ranges(out, budget):
            yield lambda r0=r0, r1=r1: ([(out.name, _cast(reader.read(unit.hybrid[0], r0, r1), dtype))], [])
        return
    if unit.per_expert:
        n = _expert_chunk(arch, unit, dtype, budget)
        for e0 in range(0, arch.num_local_experts, n):
            yield partial(_experts_to_hf, reader, arch, layout, unit, dtype, e0, min(arch.num_local_experts, e0 + n),
                          meter)
        yield RELEASE_HELD
        return
    yield partial(_unit_to_hf, reader, arch, layout, unit, dtype)


# --- plans: one per output layout ---------------------------------------------------------
@dataclass
class ConvertPlan(ABC):
    """What one conversion computes and writes: its jobs, their tasks, its writer and folder files."""

    target: ClassVar[str]
    extra_files: ClassVar[tuple[str, ...]] = EXTRA_FILES  # tokenizer files copied from the source
    source: Source
    dtype: torch.dtype
    jobs: list[Job]
    experts_in: str  # the source's expert form (bf16, mxfp4, or the dtype of a training checkpoint's experts)
    experts_out: str = "bf16"
    notes: list[str] = field(default_factory=list)  # what the user should know about this output

    @property
    def specs(self) -> list[TensorSpec]:
        return [spec for job in self.jobs for spec in job.outputs]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @abstractmethod
    def tasks(self, reader: RowReader, job: Job, budget: int, empty: Empty = fresh) -> Iterator[Task | object]:
        """The tasks computing `job`'s output in chunks of about `budget` bytes (RELEASE_HELD among
        them), into memory from `empty` where they compute into new memory."""

    @abstractmethod
    def write_files(self, folder: Path, provenance: dict) -> None:
        """The folder's files besides the weights (configs; tokenizer files are `extra_files`)."""

    def open_writer(self, folder: Path, *, provenance: dict, max_shard_bytes: int,
                    on_bytes: Callable[[int], None] | None):
        return ShardedWriter(folder, self.specs, max_shard_bytes=max_shard_bytes, on_bytes=on_bytes)

    def allocator(self, writer) -> Empty:
        """Where tasks should compute the pieces `writer` (from `open_writer`) takes."""
        return writer.empty

    def close_writer(self, writer, provenance: dict) -> None:
        writer.close()


@dataclass
class ToHybrid(ConvertPlan):
    """HF or OpenAI original -> Hybrid (decoded through the source's layout), or a training or Megatron
    checkpoint -> Hybrid (copied by name, cast to the output dtype)."""

    target: ClassVar[str] = "hybrid"

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


@dataclass
class ToHf(ConvertPlan):
    """A Hybrid-named checkpoint (Hybrid, training, Megatron) -> HF, its experts in `layout`'s form."""

    target: ClassVar[str] = "hf"
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


__all__ = ["ConvertPlan", "ToHybrid", "ToHf", "Job", "Empty", "fresh", "to_hf_plan", "plan_to_hf", "plan_to_hybrid",
           "PROVENANCE_KEY"]
