"""The visibility rule of attention as tensors: whole-sequence and per-query-block masks of a sliding
window, and the query blocks a sliding-window layer is computed in.

Key k is visible from query q iff `q - W < k <= q` (W keys, the query's own included;
docs/architecture.md, "Sliding window"), or `k <= q` without a window. FlexAttention takes the same
rule as a function (model/attention/sink_flex.py, `visibility`).
"""

from __future__ import annotations

import functools

import torch

from gptoss_cli.model.catalog import SLIDING_QUERY_BLOCK

# One query block: queries start .. stop-1 over keys k0 .. stop-1, and an additive mask
# [stop-start, stop-k0] in q's dtype (0 visible, -inf not), or None for causal with k0 == start == 0.
Block = tuple[int, int, int, "torch.Tensor | None"]


@functools.lru_cache(maxsize=16)
def attention_mask(seq_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean [seq, seq+1] mask; column 0 is the sink key (always visible), then the real keys.

    Key k is visible from query q iff `q - W < k <= q` (W keys including itself, section 2), or
    `k <= q` without a window.
    """
    q = torch.arange(seq_len, device=device)[:, None]
    k = torch.arange(seq_len, device=device)[None, :]
    visible = k <= q
    if window is not None:
        visible = visible & (k > q - window)
    sink = torch.ones(seq_len, 1, dtype=torch.bool, device=device)
    return torch.cat([sink, visible], dim=1)


@functools.lru_cache(maxsize=64)
def window_block_mask(rows: int, keys: int, offset: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean [rows, 1 + keys] mask of one query block: sink column, then keys k0 .. k0+keys-1 for
    queries a .. a+rows-1, offset = a - k0; the visibility rule of `attention_mask`."""
    q = torch.arange(rows, device=device)[:, None] + offset
    k = torch.arange(keys, device=device)[None, :]
    visible = (k <= q) & (k > q - window)
    return torch.cat([torch.ones(rows, 1, dtype=torch.bool, device=device), visible], dim=1)


@functools.lru_cache(maxsize=64)
def window_block_bias(rows: int, keys: int, offset: int, window: int, device: torch.device,
                       dtype: torch.dtype) -> torch.Tensor:
    """`window_block_mask` without the sink column, additive (0 visible, -inf not) in `dtype`:
    the form the CPU flash kernel takes."""
    visible = window_block_mask(rows, keys, offset, window, device)[:, 1:]
    return torch.zeros(rows, keys, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))




def query_blocks(s: int, window: int | None, device: torch.device, dtype: torch.dtype) -> tuple[Block, ...]:
    """The blocks a flash kernel computes a layer in: one causal block without a window (or one as long
    as the sequence), else query blocks of max(SLIDING_QUERY_BLOCK, window) over the keys each can see,
    with their additive masks. A kernel takes the mask, yet still computes every masked score: one
    call would cost S x S where S x (block + window) is the work."""
    if window is None or window >= s:
        return ((0, s, 0, None),)
    block = max(SLIDING_QUERY_BLOCK, window)
    blocks = []
    for start in range(0, s, block):
        stop, k0 = min(s, start + block), max(0, start - window + 1)
        blocks.append((start, stop, k0, window_block_bias(stop - start, stop - k0, start - k0, window, device, dtype)))
    return tuple(blocks)


__all__ = ["Block", "attention_mask", "window_block_mask", "window_block_bias", "query_blocks"]
