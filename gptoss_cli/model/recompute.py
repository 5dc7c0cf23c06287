"""Activation recompute: which pieces of which layers keep no activations for backward and recompute them.

Megatron's two granularities (docs/recompute.md):
- selective (`modules`, on every layer that has the piece):
    core_attn  the attention core (sinks, softmax, weighted values): only q, k, v are kept;
    moe_act    the experts' clamped SwiGLU output (fc2's input) is not kept; backward recomputes
               it from the fc1 output the activation keeps anyway (output-discarding);
    layernorm  the pre-attention and pre-MLP RMSNorms keep only their input; their output (the
               QKV GEMM's and the router's input) is recomputed in backward (output-discarding);
    mlp        a dense `-` layer's MLP keeps only its input;
    moe        an `E` layer's expert MLP (fc1, activation, fc2) keeps only its input. Unlike
               Megatron's `moe`, the token dispatcher's all-to-all is NOT repeated: it lies
               outside the recomputed piece.
- full (`full_units`): each unit, a range of consecutive physical layers, keeps only its input;
  backward re-runs its forward. A unit with an `E` layer under expert parallelism repeats that
  layer's dispatch and combine all-to-alls (and the count exchange).

Recompute is torch.utils.checkpoint (non-reentrant) around the pieces, plus saved-tensor hooks
that replace the saved copies of a discarded output with a recompute of it; the GEMMs (FP8
included) see the same inputs in the recompute, so they cast with the same scales.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from gptoss_cli.model.recompute_plan import SELECTIVE_MODULES, RecomputePlan

def checkpointed(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) keeping only its inputs for backward (non-reentrant torch.utils.checkpoint)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)


@contextlib.contextmanager
def discard_saved(out: torch.Tensor, recompute: Callable[[], torch.Tensor]) -> Iterator[None]:
    """Inside this block, ops that save `out` (or a view of it) for backward save a note instead,
    and backward rebuilds the view from `recompute()` (run without grad). `out` must own its storage
    from offset 0 (a fresh result), so a view is rebuilt from its size, stride and offset."""
    if not torch.is_grad_enabled() or out.storage_offset() != 0 or not out.is_contiguous():
        yield
        return
    # Only plain facts about `out` below: a closure holding `out` itself would keep it alive.
    storage, dtype, device = out.untyped_storage().data_ptr(), out.dtype, out.device

    def pack(t: torch.Tensor) -> Any:
        if t.dtype == dtype and t.device == device and t.untyped_storage().data_ptr() == storage:
            return _Discarded(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.requires_grad)
        return t

    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Discarded):
            return saved
        with torch.no_grad():
            full = recompute()
        return full.as_strided(saved.shape, saved.stride, saved.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@dataclass(frozen=True)
class _Discarded:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool


def without_output(fn: Callable[..., torch.Tensor], args: tuple, consumer: Callable[[torch.Tensor], Any]) -> Any:
    """consumer(fn(*args)) keeping neither fn's own saved tensors (fn runs checkpointed) nor the copies
    of its output the consumer saves (recomputed in backward): Megatron's output-discarding checkpoint."""
    if not torch.is_grad_enabled():
        return consumer(fn(*args))
    y = checkpointed(fn, *args)
    with discard_saved(y, lambda: fn(*args)):
        return consumer(y)


__all__ = ["SELECTIVE_MODULES", "RecomputePlan", "checkpointed", "discard_saved", "without_output"]
