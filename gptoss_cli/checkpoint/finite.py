"""Whether a tensor is finite, fast: conversion checks every weight it reads, training every state it saves."""

from __future__ import annotations

import torch


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or +-inf in `t` (True for an empty or non-float tensor)."""
    # min/max propagate NaN and show +-inf, in one vectorised pass without a mask tensor: about 35x
    # faster than isfinite().all(), which made the check cost more than the conversion itself.
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(_memory_order(t))
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of `t`'s elements in memory order when they fill a dense block (a transposed or
    permuted transform output); reducing a strided view directly is about 18x slower."""
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size != 1 and stride != expected:
            return t
        expected *= size
    return t.as_strided((t.numel(),), (1,))


__all__ = ["all_finite"]
