"""Attention sinks through SDPA with the sink as one more key: any SDPA kernel, head dim padded.

We append one feature to q (the sink logit) and to k (sqrt(head_dim) on a single extra key, zero on
the real keys), so the extra key scores exactly `sink_h` and the real keys score exactly
`q.k / sqrt(head_dim)`; its value row is zero. Any SDPA backend then computes the sink softmax,
gradients to the sinks included, at head dim d + 8 (72 for GPT-OSS's 64): 12.5% more attention
FLOPs than the unpadded paths (model/attention/sink_flash.py, model/attention/sink_flex.py). It runs on every device
and dtype, which makes it the fallback and the reference the other paths are probed against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gptoss_cli.model.attention.masks import window_block_mask
from gptoss_cli.model.catalog import SLIDING_QUERY_BLOCK


def padded_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                          window: int | None) -> torch.Tensor:
    """q [B, h, S, d], k/v [B, kv, S, d], sinks [h] -> the sink softmax's output [B, h, S, d] through SDPA
    with the sink as one more key (head dim padded to a multiple of 8); sliding windows per query block."""
    b, nh, s, d = q.shape
    nkv = k.shape[1]
    # Extra features padded to a multiple of 8 so fused kernels keep aligned head dims.
    extra = -(-(d + 1) // 8) * 8 - d
    sink_q = sinks.to(q.dtype).view(1, nh, 1, 1).expand(b, nh, s, 1)
    q_aug = torch.cat([q, sink_q, q.new_zeros(b, nh, s, extra - 1)], dim=-1)
    # sqrt(d) is exact in binary for d = 16, 64 (GPT-OSS), so the sink score is exactly sink_h.
    sink_k = k.new_zeros(b, nkv, 1, d + extra)
    sink_k[..., d] = d**0.5
    k_aug = F.pad(k, (0, extra))
    # v gets the zero sink row and the same head dim as q/k: SDPA's fused kernels (the CPU flash
    # kernel among them) need one head dim for q, k and v, else it falls back to its math path.
    # The padded output features are zero and are dropped.
    v_aug = F.pad(v, (0, extra))

    def attend(rows: slice, k0: int, mask: torch.Tensor) -> torch.Tensor:
        keys = torch.cat([sink_k, k_aug[:, :, k0:rows.stop]], dim=2)
        values = F.pad(v_aug[:, :, k0:rows.stop], (0, 0, 1, 0))
        return F.scaled_dot_product_attention(
            q_aug[:, :, rows], keys, values, attn_mask=mask, scale=d**-0.5, enable_gqa=nkv != nh
        )

    block = max(SLIDING_QUERY_BLOCK, window or 0)
    if window is None or window >= s:
        # Causal without a mask, so SDPA skips the blocks above the diagonal (and on GPUs may pick
        # the flash kernel, which takes no mask): with one all-zero query row in front, SDPA's
        # causal rule (query i sees keys 0..i) lets query t see the sink and keys 0..t. That row
        # sees only the sink, whose value row is zero; it is dropped.
        out = F.scaled_dot_product_attention(
            F.pad(q_aug, (0, 0, 1, 0)), torch.cat([sink_k, k_aug], dim=2), F.pad(v_aug, (0, 0, 1, 0)),
            is_causal=True, scale=d**-0.5, enable_gqa=nkv != nh,
        )[:, :, 1:]
    else:
        outs = []
        for start in range(0, s, block):
            stop, k0 = min(s, start + block), max(0, start - window + 1)
            mask = window_block_mask(stop - start, stop - k0, start - k0, window, q.device)
            outs.append(attend(slice(start, stop), k0, mask))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out[..., :d]




__all__ = ["padded_sink_attention"]
