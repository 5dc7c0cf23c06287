"""What a checkpoint reader answers: `TensorReader` (the whole interface) and `RowReader` (reads only).

The readers of the four stored forms (`CheckpointReader` over safetensors shards, `DcpReader` over
a training checkpoint, `MegatronReader` over a torch_dist one, `LoraMergedReader` over a base plus
its adapters) answer the same questions by tensor name, so conversion, loading and the checks take
any of them; wrappers (`Mxfp4QatReader`, conversion's finiteness check and stage clock) keep the
same `read`. Reads are of a whole tensor or of rows [start, stop) of its first dimension.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from gptoss_cli.checkpoint.storage.safetensors_io import TensorSpec


@runtime_checkable
class RowReader(Protocol):
    """Reads tensor `name`, or rows [start, stop) of its first dimension, into fresh memory."""

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor: ...


@runtime_checkable
class TensorReader(RowReader, Protocol):
    """A checkpoint's tensors by name: which there are, their specs, the file each is stored in."""

    def names(self) -> list[str]: ...

    def spec(self, name: str) -> TensorSpec: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def file_of(self, name: str) -> Path: ...

    def close(self) -> None: ...


__all__ = ["RowReader", "TensorReader"]
