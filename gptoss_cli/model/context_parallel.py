"""All-to-all (Ulysses) context parallelism: trade sequence slices for head slices around attention.

Each of the CP ranks of a group holds a contiguous slice of S/CP positions of every sequence.
Before attention, `seq_to_heads` sends head group j of its slice to rank j, which then holds the
full sequence for heads [j*h/CP, (j+1)*h/CP); after attention `heads_to_seq` sends them back.
Attention itself therefore sees whole sequences: sinks, sliding windows that cross a slice
boundary and per-document attention (cu_seqlens of the full rows) are exact. Query head chunk j
and kv head chunk j line up for GQA because both are cut into CP contiguous chunks
(query head h reads kv head h // (heads / kv_heads)). Both are differentiable (the backward of an
all-to-all is the reverse all-to-all), so every gradient, the sinks' included, is exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gptoss_cli.model.dispatcher import all_to_all


def cp_size_of(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, h, S/CP, d] (this rank's positions, every head) -> [B, h/CP, S, d] (every position, this rank's heads)."""
    cp = cp_size_of(group)
    if cp == 1:
        return x
    b, h, s, d = x.shape
    chunks = x.view(b, cp, h // cp, s, d).transpose(0, 1).reshape(cp * b, h // cp * s * d)
    got = all_to_all(chunks, [b] * cp, [b] * cp, group)  # row block i: positions of rank i
    return got.view(cp, b, h // cp, s, d).permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of `seq_to_heads`: [B, h/CP, S, d] -> [B, h, S/CP, d]."""
    cp = cp_size_of(group)
    if cp == 1:
        return x
    b, hl, full, d = x.shape
    s = full // cp
    chunks = x.view(b, hl, cp, s, d).permute(2, 0, 1, 3, 4).reshape(cp * b, hl * s * d)
    got = all_to_all(chunks, [b] * cp, [b] * cp, group)  # row block i: heads of rank i
    return got.view(cp, b, hl, s, d).transpose(0, 1).reshape(b, cp * hl, s, d)


def head_range(num_heads: int, group: Any) -> slice:
    """The query (or kv) heads this rank attends for under CP: its contiguous chunk."""
    cp = cp_size_of(group)
    if cp == 1:
        return slice(0, num_heads)
    n, r = num_heads // cp, dist.get_rank(group)
    return slice(r * n, (r + 1) * n)


def local_positions(batch: int, local_len: int, group: Any, device=None) -> torch.Tensor:
    """position_ids [B, S/CP] of this rank's slice of rows that count from 0 (no packed documents)."""
    start = 0 if group is None else dist.get_rank(group) * local_len
    return (torch.arange(local_len, device=device) + start).expand(batch, -1)


def slice_sequence(t: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous slice of dimension `dim` (the sequence) of a full-length tensor."""
    n = t.shape[dim]
    if n % cp_size:
        raise ValueError(f"sequence length {n} is not divisible by context_parallel_size={cp_size}")
    part = n // cp_size
    return t.narrow(dim, cp_rank * part, part).contiguous()


__all__ = ["seq_to_heads", "heads_to_seq", "head_range", "local_positions", "slice_sequence", "cp_size_of"]
