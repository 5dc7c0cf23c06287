"""A LoRA training checkpoint read as merged weights: the frozen base's tensors plus scaling * B @ A.

`LoraMergedReader` has the reader interface of CheckpointReader / DcpReader over Hybrid names: the
base's tensors, and for every adapted weight (`<layer>.weight`, or `<layer>.weight{e}` of an
expert) the base tensor plus its adapter's delta, computed in fp32 (the caller casts once to its
output dtype, so the fine-tune is rounded once, not twice). Conversion, loading and parity read a
LoRA checkpoint through it as if it were a full one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gptoss_cli.checkpoint.safetensors_io import TensorSpec
from gptoss_cli.model.expert_names import expert_name, parse_expert_name
from gptoss_cli.model.lora import ADAPTER, LINEAR_IN, LINEAR_OUT


def adapter_names(name: str) -> tuple[str, str] | None:
    """(A's name, B's name) of the adapter of a Hybrid weight name, by the model's naming (model/lora.py)."""
    per_expert = parse_expert_name(name)
    stack = name if per_expert is None else per_expert.stack
    if not stack.endswith(".weight"):
        return None
    stem = f"{stack.removesuffix('.weight')}.{ADAPTER}"
    pair = f"{stem}.{LINEAR_IN}.weight", f"{stem}.{LINEAR_OUT}.weight"
    return pair if per_expert is None else tuple(expert_name(p, per_expert.expert) for p in pair)


class LoraMergedReader:
    """Base tensors (Hybrid names, `base`) with the adapters of `adapters` merged in at `scaling`."""

    concurrent_reads = False  # the adapters come from a DcpReader, which serves one stream of reads

    def __init__(self, base, adapters, scaling: float):
        self.base, self.adapters, self.scaling = base, adapters, scaling
        self.folder = getattr(base, "folder", None)
        self.merged = 0  # adapted tensors read so far
        self._held: dict[str, torch.Tensor] | None = None

    def close(self) -> None:
        self.base.close()
        self.adapters.close()

    def names(self) -> list[str]:
        return self.base.names()

    def __contains__(self, name: str) -> bool:
        return name in self.base

    def spec(self, name: str) -> TensorSpec:
        return self.base.spec(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.base.dtype(name)

    def file_of(self, name: str) -> Path:
        return self.base.file_of(name)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        t = self.base.read(name, start, stop)
        pair = adapter_names(name)
        if pair is None or pair[0] not in self.adapters:
            return t
        if self._held is None:  # adapters are small (about 1% of the base): read them once, in order
            self._held = {n: self.adapters.read(n) for n in self.adapters.names()}
        a = self._held[pair[0]].float()
        b = self._held[pair[1]][start:stop].float()  # rows of the output = rows of B
        self.merged += 1
        return t.float() + (b @ a) * self.scaling


__all__ = ["LoraMergedReader", "adapter_names"]
