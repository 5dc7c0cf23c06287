"""The writer-plan interface: what every format's `convert --to NAME` plan answers (`ConvertPlan`), and
the machinery plans share (jobs, where a task computes into, row ranges, expert chunks).

A plan is one object per output layout, saying what a conversion reads, computes and writes. Each
writable row's package holds its plan beside the row: `ToHybrid` (formats/hybrid/plan.py), `ToHf`
(formats/hf/plan.py), `ToMegatron` (formats/megatron/plan.py) and `ToPeft` (formats/peft/plan.py);
the row's `plan` builds it. Convert's `make_plan` checks a source and asks the target's row for its
plan; `convert()` then runs any plan the same way: its jobs, cut into tasks, through the thread
pipeline into the plan's writer, then the plan's folder files. This module knows no format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import torch

from gptoss_cli.checkpoint.formats.registry import Source
from gptoss_cli.checkpoint.mapping import Unit, identity
from gptoss_cli.checkpoint.storage.pipeline import Task
from gptoss_cli.checkpoint.storage.readers import RowReader
from gptoss_cli.checkpoint.storage.safetensors_io import ShardedWriter, TensorSpec
from gptoss_cli.model.config import GptOssArch

# What an output records about its source: HF's in the index's metadata (config.json stays as released),
# PEFT's in its one file's metadata
PROVENANCE_KEY = "gptoss_provenance"


# --- jobs: the output tensors of each table unit, in write order ---------------------------
@dataclass
class Job:
    """A bound table unit (or what else a plan cuts its work by) plus the output tensors it writes, in write order."""

    unit: Any  # a mapping-table Unit; ToPeft: an HF block index
    outputs: list[TensorSpec]


def expert_chunk(arch: GptOssArch, unit: Unit, dtype: torch.dtype, budget: int) -> int:
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


# --- tasks: how each direction computes a job's output pieces ----------------------------
# Where a task computes an output piece: (tensor name, first row, shape, dtype) -> a fresh tensor.
# The safetensors writer's `empty` places it for its O_DIRECT writes (no copy on the way out).
Empty = Callable[[str, int, tuple[int, ...], torch.dtype], torch.Tensor]


def fresh(name: str, row: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Any memory will do (a writer that copies anyway)."""
    return torch.empty(shape, dtype=dtype)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A floating-point tensor in the output dtype; MXFP4 bytes and other integers as they are."""
    return t.to(dtype) if t.is_floating_point() else t


def row_ranges(spec: TensorSpec, budget: int):
    """Row ranges of about `budget` bytes, so that a 1 GB embedding is never held whole."""
    step = max(1, budget // max(1, spec.row_bytes))
    rows = spec.shape[0] if spec.shape else 1
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def streams_rows(unit: Unit, spec: TensorSpec) -> bool:
    """Whether a unit's one output is its one input unchanged, so it can be copied in row ranges."""
    return unit.mapping.to_hybrid is identity and len(unit.hf) == 1 and len(spec.shape) >= 1


# --- the interface ------------------------------------------------------------------------
@dataclass
class ConvertPlan(ABC):
    """What one conversion computes and writes: its jobs, their tasks, its writer and folder files."""

    target: ClassVar[str]
    extra_files: ClassVar[tuple[str, ...]] = ()  # files copied from the source's extras folder (tokenizer files)
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

    def dtype_label(self) -> str:
        """The output's --dtype as the result reports it."""
        from gptoss_cli.model.dtypes import dtype_name  # noqa: PLC0415

        return dtype_name(self.dtype)

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


__all__ = ["ConvertPlan", "Job", "Empty", "fresh", "cast", "row_ranges", "streams_rows", "expert_chunk",
           "PROVENANCE_KEY"]
