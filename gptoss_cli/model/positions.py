"""Positions of a batch and its packed documents: document offsets (cu_seqlens) from document lengths,
positions that restart in every document, and the default position ids (from 0 in every row or
document, on this rank's CP slice)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gptoss_cli.model.context_parallel import cp_size_of, local_positions, slice_sequence


def document_offsets(seqlens: list[list[int]], seq_len: int) -> tuple[int, ...]:
    """cu_seqlens of `document_attention` from each row's document lengths (a row's lengths summing
    to less than seq_len leave the rest of the row as one more segment, its padding)."""
    offsets = [0]
    for row, lengths in enumerate(seqlens):
        for n in lengths:
            if n < 1:
                raise ValueError(f"row {row}: document length {n} < 1")
            offsets.append(offsets[-1] + n)
        end = (row + 1) * seq_len
        if offsets[-1] > end:
            raise ValueError(f"row {row}: documents of {sum(lengths)} tokens exceed the row of {seq_len}")
        if offsets[-1] < end:
            offsets.append(end)
    return tuple(offsets)


def document_positions(cu_seqlens: tuple[int, ...], batch: int, seq_len: int, device=None) -> torch.Tensor:
    """position_ids [B, S] that restart at 0 at every offset of cu_seqlens."""
    idx = torch.arange(batch * seq_len)
    starts = torch.tensor(cu_seqlens[:-1])
    lengths = torch.tensor(cu_seqlens[1:]) - starts
    pos = idx - torch.repeat_interleave(starts, lengths)
    return pos.view(batch, seq_len).to(device)


def default_position_ids(input_ids: torch.Tensor, cu_seqlens: tuple[int, ...] | None = None,
                         cp_group: Any = None) -> torch.Tensor:
    """position_ids [B, S] of `input_ids` [B, S]: from 0 in every row, or in every document of
    `cu_seqlens` (packed documents, offsets into the full rows). Under context parallelism
    `input_ids` is this rank's slice of every row: the positions of the full rows, then the slice."""
    b, s = input_ids.shape
    cp = cp_size_of(cp_group)
    if cp > 1:
        if cu_seqlens is None:
            return local_positions(b, s, cp_group, input_ids.device)
        return slice_sequence(document_positions(cu_seqlens, b, s * cp, device=input_ids.device),
                              cp, dist.get_rank(cp_group))
    if cu_seqlens is not None:
        return document_positions(cu_seqlens, b, s, device=input_ids.device)
    return torch.arange(s, device=input_ids.device).expand(b, -1)


__all__ = ["document_offsets", "document_positions", "default_position_ids"]
