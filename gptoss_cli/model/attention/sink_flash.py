"""Attention sinks from a flash kernel's log-sum-exp: the sink softmax without a padded head dim.

The sink of query head h is one more softmax column with score `sink_h` and a zero value row
(reference section 2). Plain attention over the real keys gives `out = P V` and `lse`, the
log-sum-exp of the real scores per query row. Adding the sink column changes only the
normaliser:

    lse' = logaddexp(lse, sink_h),   P' = exp(s - lse') = P * exp(lse - lse'),   out' = out * exp(lse - lse').

Backward. The sink softmax is a softmax over the real columns and the sink column, whose value
row is zero (dP'_sink = 0). Its backward is dS = P' * (dP' - D') with dP' = dO' V^T and
D' = rowsum(P' * dP') = rowsum(dO' * out'), which is exactly what a flash backward computes when it
is handed the FINAL output out' and the FINAL log-sum-exp lse' (it rebuilds P' = exp(s - lse') and
D' from them). The sink's own gradient is that of its column: p_sink * (0 - D') with
p_sink = exp(sink_h - lse'), summed over batch and query rows per head.

`SinkFlashAttention` runs a flash kernel once per query block, so q, k and v keep their own head dim
(64 in GPT-OSS, not 72):
  * on the CPU, torch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu` and its
    backward), which takes GQA kv heads and an additive mask: every layer kind;
  * on CUDA, torch's flash kernel (`_scaled_dot_product_flash_attention` and its backward; GQA kv
    heads, bf16/fp16, head dim a multiple of 8 up to 256), which takes no mask: causal blocks only,
    i.e. full-attention layers (and documents no longer than the window). Its backward is handed
    the forward's random-number state (unused: no dropout).
`available(q)` says whether a kernel runs for q at all, `takes_masks(q)` whether it takes the
sliding-window blocks' masks.
"""

from __future__ import annotations

import torch

from gptoss_cli.model.attention.masks import Block

def _op(name: str):
    try:
        return getattr(torch.ops.aten, name).default
    except (AttributeError, RuntimeError):  # a torch build without that kernel
        return None


_FORWARD = _op("_scaled_dot_product_flash_attention_for_cpu")
_BACKWARD = _op("_scaled_dot_product_flash_attention_for_cpu_backward")
_CUDA_FORWARD = _op("_scaled_dot_product_flash_attention")
_CUDA_BACKWARD = _op("_scaled_dot_product_flash_attention_backward")

# Dtypes the CPU flash kernel computes (its log-sum-exp is fp32 for the 16-bit ones), and the CUDA one.
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.bfloat16, torch.float16)

def available(q: torch.Tensor) -> bool:
    """Whether `SinkFlashAttention` runs for q: a plain tensor of a dtype a flash kernel computes, on the
    CPU, or on CUDA with a head dim the CUDA kernel takes (there only for causal blocks: `takes_masks`)."""
    if type(q) is not torch.Tensor:
        return False
    if q.device.type == "cpu":
        return _FORWARD is not None and q.dtype in _DTYPES
    return (q.device.type == "cuda" and _CUDA_FORWARD is not None and q.dtype in _CUDA_DTYPES
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)


def takes_masks(q: torch.Tensor) -> bool:
    """Whether the kernel for q takes a mask (the CPU's does; CUDA's computes causal blocks only)."""
    return q.device.type == "cpu"


def _kernel_forward(q, k, v, mask, scale: float):
    """One block's plain attention -> (out, lse [B, h, rows], the state its backward needs)."""
    if q.device.type == "cpu":
        out, lse = _FORWARD(q, k, v, 0.0, mask is None, attn_mask=mask, scale=scale)
        return out, lse, None
    if mask is not None:
        raise ValueError("the CUDA flash kernel takes no mask; a sliding-window block needs FlexAttention or SDPA")
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _CUDA_FORWARD(q, k, v, 0.0, True, False, scale=scale)
    return out, lse[..., :q.shape[2]], (cum_q, cum_k, max_q, max_k, seed, offset)


def _kernel_backward(grad_out, q, k, v, out, lse, mask, state, scale: float):
    if state is None:
        return _BACKWARD(grad_out, q, k, v, out, lse, 0.0, mask is None, attn_mask=mask, scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return _CUDA_BACKWARD(grad_out.contiguous(), q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0,
                          True, seed, offset, scale=scale)


def _flash_forward(q, k, v, blocks: tuple[Block, ...], scale: float):
    """Plain attention over the real keys per block -> (out [B, h, S, d], lse [B, h, S], per-block states)."""
    outs, lses, states = [], [], []
    for start, stop, k0, mask in blocks:
        out, lse, state = _kernel_forward(q[:, :, start:stop], k[:, :, k0:stop], v[:, :, k0:stop], mask, scale)
        outs.append(out)
        lses.append(lse)
        states.append(state)
    if len(blocks) == 1:
        return outs[0], lses[0], states
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2), states


class SinkFlashAttention(torch.autograd.Function):
    """q [B, h, S, d], k/v [B, kv, S, d], sinks [h] -> the sink softmax's output [B, h, S, d]."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, blocks: tuple[Block, ...], scale: float):
        out, lse, states = _flash_forward(q, k, v, blocks, scale)
        lse_f = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
        # In place: `out` is the kernel's (or the blocks' concatenation), no one else holds it.
        out_f = out.mul_(torch.exp(lse - lse_f).unsqueeze(-1))
        ctx.save_for_backward(q, k, v, sinks, out_f, lse_f)
        ctx.blocks, ctx.scale, ctx.states = blocks, scale, states
        return out_f

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, sinks, out_f, lse_f = ctx.saved_tensors
        grad_out = grad_out.to(q.dtype)
        blocks = ctx.blocks
        if len(blocks) == 1:
            (start, stop, k0, mask), = blocks
            dq, dk, dv = _kernel_backward(grad_out, q, k, v, out_f, lse_f, mask, ctx.states[0], ctx.scale)
        else:
            dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
            for (start, stop, k0, mask), state in zip(blocks, ctx.states):
                rows, keys = slice(start, stop), slice(k0, stop)
                gq, gk, gv = _kernel_backward(grad_out[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                              out_f[:, :, rows], lse_f[:, :, rows], mask, state, ctx.scale)
                dq[:, :, rows] = gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
        # d sink_h = -sum over batch and rows of p_sink * rowsum(dO' * out')
        delta = torch.linalg.vecdot(grad_out.to(lse_f.dtype), out_f.to(lse_f.dtype))
        p_sink = torch.exp(sinks.to(lse_f.dtype).view(1, -1, 1) - lse_f)
        dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None


def sink_flash_attention(q, k, v, sinks, blocks: tuple[Block, ...], scale: float) -> torch.Tensor:
    """`SinkFlashAttention` (see the module docstring); the caller checks `available(q)`."""
    return SinkFlashAttention.apply(q, k, v, sinks, blocks, scale)


__all__ = ["available", "takes_masks", "sink_flash_attention", "SinkFlashAttention"]
