"""Default position ids of a batch: counting from 0 in every row, or in every packed document, on this rank's CP slice."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gptoss_cli.model.attention import document_positions
from gptoss_cli.model.context_parallel import cp_size_of, local_positions, slice_sequence


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


__all__ = ["default_position_ids"]
