"""Whether a tensor is finite, fast: conversion checks every weight it reads (`NonFiniteCheck`), training every state it saves."""

from __future__ import annotations

from pathlib import Path

import torch

from gptoss_cli.checkpoint.storage.readers import TensorReader
from gptoss_cli.errors import CheckpointError


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


class NonFiniteCheck:
    """Refuse NaN/inf weights, naming the tensor: every forward through one would be NaN.

    Wraps the source reader. Float tensors are checked as read (one min/max pass per chunk). MXFP4
    tensors are checked through their scales: byte 255 is NaN (OCP E8M0), and only bytes >= 253
    (2**126 and up) can push a decoded value past the bf16/fp32 range; then, and only then, the
    decoded outputs are checked too. Transforms of finite values are finite otherwise, so the
    common case costs one cheap pass over the float tensors and none over decoded experts.
    """

    def __init__(self, reader: TensorReader):
        self._reader = reader
        self.check_outputs = False

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        t = self._reader.read(name, start, stop)
        if t.is_floating_point():
            raise_if_not_finite(t, name, f"{self._reader.file_of(name)}: tensor", start or 0)
        elif t.dtype == torch.uint8 and name.endswith("scales") and t.numel():
            top = int(t.max())
            if top == 255:
                raise CheckpointError(
                    f"{self._reader.file_of(name)}: tensor {name!r} holds the MXFP4 scale byte 255, which is NaN "
                    "(OCP E8M0)", hint="the checkpoint is corrupt; convert a finite one",
                )
            self.check_outputs |= top >= 253
        return t

    def wrap_write(self, write, where: Path):
        offsets: dict[str, int] = {}

        def checked(name: str, chunk: torch.Tensor) -> None:
            if self.check_outputs:
                raise_if_not_finite(chunk, name, f"{where}: output tensor", offsets.get(name, 0))
                offsets[name] = offsets.get(name, 0) + (chunk.shape[0] if chunk.dim() else 1)
            write(name, chunk)

        return checked


def raise_if_not_finite(t: torch.Tensor, name: str, what: str, row0: int) -> None:
    """A CheckpointError naming `what` `name` and its first non-finite element, if `t` (rows from `row0` on) has one."""
    if all_finite(t):
        return
    bad = ~torch.isfinite(t)
    index = [int(i) for i in bad.nonzero()[0]]
    value = t[tuple(index)].item()
    if index:  # chunks are row ranges: report the index in the whole tensor
        index[0] += row0
    raise CheckpointError(
        f"{what} {name!r} holds non-finite values (first: {value} at {index}; {int(bad.sum())} in the rows read)",
        hint="the checkpoint is corrupt or diverged; convert a finite one",
    )


__all__ = ["all_finite", "NonFiniteCheck", "raise_if_not_finite"]
