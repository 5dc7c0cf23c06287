"""Attention sinks from the CPU flash kernel's log-sum-exp: the sink softmax without a padded head dim.

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

`SinkFlashAttention` runs torch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`
and its backward, which take GQA kv heads and an additive mask) once per query block, so q, k and
v keep their own head dim (64 in GPT-OSS, not 72). `available(q)` says where it applies: on the
CPU with that op present; other devices keep the padded path of model/attention.py (the CUDA
flash kernel takes no arbitrary mask).
"""

from __future__ import annotations

import torch

try:
    _FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    _BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
except (AttributeError, RuntimeError):  # a torch build without the CPU flash kernel
    _FORWARD = _BACKWARD = None

# Dtypes the CPU flash kernel computes (its log-sum-exp is fp32 for the 16-bit ones).
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

# One query block: queries start .. stop-1 over keys k0 .. stop-1, and an additive mask
# [stop-start, stop-k0] in q's dtype (0 visible, -inf not), or None for causal with k0 == start == 0.
Block = tuple[int, int, int, "torch.Tensor | None"]


def available(q: torch.Tensor) -> bool:
    """Whether `SinkFlashAttention` runs for q: a plain CPU tensor of a dtype the kernel computes."""
    return _FORWARD is not None and q.device.type == "cpu" and q.dtype in _DTYPES and type(q) is torch.Tensor


def _flash_forward(q, k, v, blocks: tuple[Block, ...], scale: float):
    """Plain attention over the real keys per block -> (out [B, h, S, d], lse [B, h, S])."""
    outs, lses = [], []
    for start, stop, k0, mask in blocks:
        out, lse = _FORWARD(q[:, :, start:stop], k[:, :, k0:stop], v[:, :, k0:stop], 0.0, mask is None,
                            attn_mask=mask, scale=scale)
        outs.append(out)
        lses.append(lse)
    if len(blocks) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


class SinkFlashAttention(torch.autograd.Function):
    """q [B, h, S, d], k/v [B, kv, S, d], sinks [h] -> the sink softmax's output [B, h, S, d]."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, blocks: tuple[Block, ...], scale: float):
        out, lse = _flash_forward(q, k, v, blocks, scale)
        lse_f = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
        # In place: `out` is the kernel's (or the blocks' concatenation), no one else holds it.
        out_f = out.mul_(torch.exp(lse - lse_f).unsqueeze(-1))
        ctx.save_for_backward(q, k, v, sinks, out_f, lse_f)
        ctx.blocks, ctx.scale = blocks, scale
        return out_f

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, sinks, out_f, lse_f = ctx.saved_tensors
        grad_out = grad_out.to(q.dtype)
        blocks = ctx.blocks
        if len(blocks) == 1:
            (start, stop, k0, mask), = blocks
            dq, dk, dv = _BACKWARD(grad_out, q, k, v, out_f, lse_f, 0.0, mask is None,
                                   attn_mask=mask, scale=ctx.scale)
        else:
            dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
            for start, stop, k0, mask in blocks:
                rows, keys = slice(start, stop), slice(k0, stop)
                gq, gk, gv = _BACKWARD(grad_out[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                       out_f[:, :, rows], lse_f[:, :, rows], 0.0, mask is None,
                                       attn_mask=mask, scale=ctx.scale)
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


__all__ = ["available", "sink_flash_attention", "SinkFlashAttention"]
