"""Every private torch name gptoss uses, in one place, behind a check of the installed torch version.

torch's `_`-prefixed functions, modules and attributes carry no compatibility promise: a new torch may
rename one, change its arguments or, worse, what it computes, and nothing would say so. gptoss needs
a few: the grouped and scaled GEMMs, the fused AdamW step, FlexAttention's reference op and dynamo's
config, the CPU flash-attention op, the CUDA driver's version, DCP's storage record, ShardedTensor's
constructor from local shards, and the runtime bookkeeping of torch.distributed.pipelining that the
pipeline stages and DualPipeV's overlap hook repeat (docs/pipeline-parallel.md). The package reaches
them only through this module (tests/test_private_imports.py fails on any other use).

Every function that uses one first calls `require(feature)`, which refuses a torch outside `TESTED`,
the minor versions the test suite has passed on, in one sentence naming the version and the feature
(a ConfigError: exit 2). The check runs where a feature is used, never at import, so a command that
needs none of them runs on any torch. The `has_*` questions answer on any version: they only look.
To support a new torch: run the suite and the GPU checks on it, then widen `TESTED`.
"""

from __future__ import annotations

import functools
import re
from types import SimpleNamespace
from typing import Any

import torch

from gptoss_cli.errors import ConfigError

# The oldest and the newest torch minor version the suite has passed on (the CPU wheel 2.13, the GPU image's 2.11).
TESTED = ((2, 11), (2, 13))

# What each feature is called in the refusal.
GROUPED_MM = "torch._grouped_mm (the experts' grouped GEMM)"
SCALED_MM = "torch._scaled_mm (the FP8 GEMM)"
SCALED_GROUPED_MM = "torch._scaled_grouped_mm (the experts' FP8 grouped GEMM)"
FUSED_ADAMW = "torch._fused_adamw_ (the optimizer step)"
FLEX_ATTENTION = "torch._higher_order_ops.flex_attention and torch._dynamo.config (FlexAttention with sinks)"
CPU_FLASH_ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu (cached decode attention)"
CUDA_DRIVER = "torch._C._cuda_getDriverVersion (the CUDA driver's version)"
DCP_STORAGE = "torch.distributed.checkpoint.filesystem._StorageInfo (distributed checkpoint storage records)"
SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor (the distributed optimizer's checkpoint state)"
PIPELINING = "torch.distributed.pipelining's stage and schedule internals (pipeline parallelism)"


@functools.lru_cache(maxsize=None)
def minor_version(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string ('2.13.0+cpu', '2.14.0.dev20260101'); None if unreadable."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def tested(version: str) -> bool:
    """Whether torch `version` lies in the tested range."""
    v = minor_version(version)
    return v is not None and TESTED[0] <= v <= TESTED[1]


def require(feature: str) -> None:
    """Refuse the installed torch for `feature` unless its version was tested."""
    version = str(torch.__version__)
    if not tested(version):
        (a, b), (c, d) = TESTED
        raise ConfigError(
            f"{feature} is private to torch and untested on torch {version}: gptoss is tested with torch "
            f"{a}.{b} to {c}.{d}",
            hint=f"pip install torch=={c}.{d}.0; or run the test suite on this torch and widen TESTED in "
                 "gptoss_cli/torch_private.py")


# --- GEMMs and the optimizer step ---------------------------------------------------------------------
def has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    require(GROUPED_MM)
    return torch._grouped_mm(a, b, offs=offs)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    require(SCALED_MM)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def has_scaled_grouped_mm() -> bool:
    return hasattr(torch, "_scaled_grouped_mm")


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    require(SCALED_GROUPED_MM)
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype)


def fused_adamw_(*tensor_lists: list[torch.Tensor], **options: Any) -> None:
    """torch's fused multi-tensor AdamW, in place (the arguments are torch's)."""
    require(FUSED_ADAMW)
    torch._fused_adamw_(*tensor_lists, **options)


# --- attention ------------------------------------------------------------------------------------------
def has_flex_attention_op() -> bool:
    """Whether this torch has FlexAttention's higher-order op (torch >= 2.5)."""
    try:
        from torch._higher_order_ops.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flex_attention_op() -> Any:
    """FlexAttention's higher-order op: its reference implementation, with autograd."""
    require(FLEX_ATTENTION)
    from torch._higher_order_ops.flex_attention import flex_attention

    return flex_attention


def dynamo_config() -> Any:
    """torch._dynamo.config (its `patch` sets a compile option for a block)."""
    require(FLEX_ATTENTION)
    import torch._dynamo

    return torch._dynamo.config


def has_cpu_flash_attention() -> bool:
    """Whether this torch build has the CPU flash-attention kernel."""
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    except (AttributeError, RuntimeError):
        return False
    return True


def cpu_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, log-sum-exp) of the CPU flash kernel, no dropout, not causal."""
    require(CPU_FLASH_ATTENTION)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    return op(q, k, v, 0.0, False, attn_mask=attn_mask, scale=scale)


# --- CUDA, distributed checkpoint -----------------------------------------------------------------------
def cuda_driver_version() -> int:
    """The CUDA version the driver supports, e.g. 12040."""
    require(CUDA_DRIVER)
    return torch._C._cuda_getDriverVersion()


def dcp_storage_info() -> type:
    """DCP's record of where a chunk lies in a file (relative_path, offset, length)."""
    require(DCP_STORAGE)
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def sharded_tensor_api() -> SimpleNamespace:
    """Shard, ShardMetadata, ShardedTensorMetadata, TensorProperties and `from_local_shards(shards,
    metadata)`, the ShardedTensor of these local shards under this global metadata (no collective)."""
    require(SHARDED_TENSOR)
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    return SimpleNamespace(Shard=Shard, ShardMetadata=ShardMetadata, ShardedTensorMetadata=ShardedTensorMetadata,
                           TensorProperties=TensorProperties,
                           from_local_shards=ShardedTensor._init_from_local_shards_and_global_metadata)


# --- torch.distributed.pipelining's runtime -------------------------------------------------------------
# The stage classes (schedule/pipeline/stage.py, plan_stage.py) also override and read attributes of
# torch's PipelineStage that have public names but no documented contract (fwd_cache, bwd_cache,
# dw_runner, backward_one_chunk's arguments, clear_runtime_states): they call `require(PIPELINING)`
# when built, so that contract is checked by the same version range.
def retrieve_recv_activations(stage: Any, index: int) -> tuple:
    """The activations microbatch `index` received from the previous stage."""
    require(PIPELINING)
    return stage._retrieve_recv_activations(index)


def retrieve_recv_grads(stage: Any, index: int) -> tuple:
    """The gradients microbatch `index` received from the next stage."""
    require(PIPELINING)
    return stage._retrieve_recv_grads(index)


def check_chunk_id(stage: Any, index: int) -> None:
    """torch's bound check of a microbatch index against the stage's chunk count."""
    require(PIPELINING)
    stage._check_chunk_id(index)


def schedule_stages(schedule: Any) -> list:
    """The stages a multi-stage schedule runs on this rank."""
    require(PIPELINING)
    return schedule._stages


def wait_batch_p2p(work: list) -> None:
    """Wait for a batch of the schedule's point-to-point operations."""
    require(PIPELINING)
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    _wait_batch_p2p(work)


def schedule_loss(schedule: Any, stage: Any, index: int) -> Any:
    """The loss the schedule computed for microbatch `index` on its last stage (None elsewhere)."""
    require(PIPELINING)
    return schedule._maybe_get_loss(stage, index)


def compute_schedule_loss(schedule: Any, stage: Any, output: Any, targets: list, index: int) -> None:
    """Have the schedule compute (and keep) microbatch `index`'s loss if `stage` is the last."""
    require(PIPELINING)
    schedule._maybe_compute_loss(stage, output, targets, index)


__all__ = ["TESTED", "require", "tested", "minor_version", "has_grouped_mm", "grouped_mm", "scaled_mm",
           "has_scaled_grouped_mm", "scaled_grouped_mm", "fused_adamw_", "has_flex_attention_op",
           "flex_attention_op", "dynamo_config", "has_cpu_flash_attention", "cpu_flash_attention",
           "cuda_driver_version", "dcp_storage_info", "sharded_tensor_api", "retrieve_recv_activations",
           "retrieve_recv_grads", "check_chunk_id", "schedule_stages", "wait_batch_p2p", "schedule_loss",
           "compute_schedule_loss", "PIPELINING"]
