"""Attention sinks through FlexAttention: one block mask for the sliding window and the packed documents,
the sink applied from the log-sum-exp FlexAttention returns.

Visibility (docs/architecture.md, "Sliding window"): key k is visible from query q iff `k <= q`,
`q - k < W` on a sliding-window layer, and both lie in the same document (cu_seqlens). FlexAttention
takes that rule as a `mask_mod` and turns it into a block mask, so a kernel visits only the key blocks
a query block can see: the work of a window layer is S x (W + block), not S x S, without the per-block
Python loop the other paths need, and all documents of a batch run in one call.

The sink of query head h is one more softmax column with score `sink_h` and a zero value row. With
`out` and `lse` (the log-sum-exp of the real scores per query row) from plain attention,

    lse' = logaddexp(lse, sink_h),   out' = out * exp(lse - lse'),

exactly as model/attention/sink_flash.py does with the flash kernel. Here autograd differentiates that
formula: FlexAttention's backward takes the gradient of its log-sum-exp, so the gradients of q, k, v
and of the sinks all come out of one backward.

Where it runs:
  * compiled (`torch.compile(flex_attention)`): the generated fused kernels, forward and backward, on
    CUDA. torch refuses FlexAttention's backward on the CPU, compiled or not ("FlexAttention does not
    support backward on CPU");
  * eager, elsewhere (the CPU; or compilation switched off, TORCH_COMPILE_DISABLE=1): FlexAttention's
    reference implementation, the higher-order op `torch._higher_order_ops.flex_attention` called
    directly (the public function only adds the device check that refuses the CPU's backward). It
    computes the same mask, block mask and log-sum-exp in the dense math form with its own backward,
    so the tests check the formula above, the mask and the sink gradients on the CPU. Its log-sum-exp
    is in base 2 (the public function converts it; so does `_eager`). It materialises every score:
    right, and no faster than the padded path; `auto` never picks it on a CPU.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import warnings
from typing import Any, Callable

import torch

from gptoss_cli import torch_private

# FlexAttention's options as the public function fills them in (torch 2.13), with the log-sum-exp on.
_EAGER_OPTIONS = {"BACKEND": "AUTO", "PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False,
                  "BLOCKS_ARE_CONTIGUOUS": False, "WRITE_DQ": True, "OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}
_compiled: dict[str, Callable[..., Any]] = {}
_lock = threading.Lock()


def available() -> bool:
    """Whether this torch has FlexAttention (torch >= 2.5) and its reference implementation."""
    if not torch_private.has_flex_attention_op():
        return False
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
    except ImportError:
        return False
    return True


def compiles(device: torch.device) -> bool:
    """Whether this call runs the compiled kernels: a CUDA (or other accelerator) device and compilation on."""
    return device.type not in ("cpu", "meta") and os.environ.get("TORCH_COMPILE_DISABLE", "0") != "1"


def document_ids(cu_seqlens: tuple[int, ...], batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """int32 [B, S]: the index of the document each token lies in (cu_seqlens: offsets into the
    flattened [B*S] tokens, every row start included; see model/attention/backends.py, `document_attention`)."""
    starts = torch.tensor(cu_seqlens[:-1])
    lengths = torch.tensor(cu_seqlens[1:]) - starts
    ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)
    return ids.view(batch, seq).to(device)


def visibility(window: int | None, docs: torch.Tensor | None) -> Callable[..., torch.Tensor]:
    """The mask_mod (b, h, q, k) -> visible of a layer: causal, within `window` keys (the query's own
    included), within one document of `docs` [B, S] (None: the whole row is one document)."""

    def mask_mod(b, h, q_idx, kv_idx):
        visible = kv_idx <= q_idx
        if window is not None:
            visible = visible & (q_idx - kv_idx < window)
        if docs is not None:
            visible = visible & (docs[b, q_idx] == docs[b, kv_idx])
        return visible

    return mask_mod


@functools.lru_cache(maxsize=8)
def block_mask(batch: int, seq: int, window: int | None, cu_seqlens: tuple[int, ...] | None, device: torch.device):
    """FlexAttention's BlockMask of one layer kind and batch layout (cached: every layer of a kind in a
    forward, and every microbatch with the same documents, reuses it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = None if cu_seqlens is None else document_ids(cu_seqlens, batch, seq, device)
    rows = None if docs is None else batch  # without documents every row has the same mask
    return create_block_mask(visibility(window, docs), rows, None, seq, seq, device=device)


def _compiled_flex() -> Callable[..., Any]:
    with _lock:
        if "flex" not in _compiled:
            from torch.nn.attention.flex_attention import flex_attention

            _compiled["flex"] = torch.compile(flex_attention, dynamic=False)
        return _compiled["flex"]


# Compiled variants one process may need: (sequence, heads, head dim, dtype) x (window or none) x (documents
# or not) x grad mode; dynamo's default limit of 8 per function would silently send the rest to the
# unfused reference, which materialises every score.
RECOMPILE_LIMIT = 64


def _fused(q, k, v, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled kernels: (out, natural log-sum-exp fp32)."""
    flex = _compiled_flex()
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch < 2.9: the older keyword
        AuxRequest = None
    config = torch_private.dynamo_config()
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.7
    with config.patch(**{limit: RECOMPILE_LIMIT}):
        if AuxRequest is None:
            return flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_lse=True)
        out, aux = flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _eager(q, k, v, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's reference implementation (the higher-order op, with autograd): (out, natural lse)."""
    out, lse_base2, _ = torch_private.flex_attention_op()(q, k, v, _score, mask.as_tuple(), scale, dict(_EAGER_OPTIONS))
    return out, lse_base2 * math.log(2.0)


def _score(score, b, h, q_idx, kv_idx):
    return score


_warned: set[str] = set()


def sink_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                        window: int | None, cu_seqlens: tuple[int, ...] | None, scale: float) -> torch.Tensor:
    """q [B, h, S, d], k/v [B, kv, S, d], sinks [h] -> the sink softmax's output [B, h, S, d], within
    `window` and the documents of `cu_seqlens` (None: one per row)."""
    b, _, s, _ = q.shape
    if window is not None and window >= s:
        window = None
    mask = block_mask(b, s, window, cu_seqlens, q.device)
    if compiles(q.device):
        out, lse = _fused(q, k, v, mask, scale)
    else:
        if q.device.type != "cpu" and "eager" not in _warned:
            _warned.add("eager")
            warnings.warn(f"FlexAttention runs its unfused reference on {q.device.type} (compilation is off): "
                          "every score is materialised", stacklevel=3)
        out, lse = _eager(q, k, v, mask, scale)
    lse = lse.to(torch.promote_types(lse.dtype, torch.float32))  # fp32, fp64 for fp64 inputs
    lse_f = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    return out * torch.exp(lse - lse_f).unsqueeze(-1).to(out.dtype)


__all__ = ["available", "compiles", "document_ids", "visibility", "block_mask", "sink_flex_attention"]
