"""A LoRA training checkpoint read as merged weights: the frozen base's tensors plus scaling * B @ A.

`LoraMergedReader` has the reader interface of CheckpointReader / DcpReader over Hybrid names: the
base's tensors, and for every adapted weight (`<layer>.weight`, or `<layer>.weight{e}` of an
expert) the base tensor plus its adapter's delta, in fp32 by `model.lora.merged_weight` (the formula
a QAT run's forward rounds; the caller casts once to its output dtype, so the fine-tune is rounded
once, not twice). Conversion, loading and parity read a LoRA checkpoint through it as if it were a
full one. `HfHybridView` serves an HF (or OpenAI original)
base under Hybrid names, so adapters trained on a released checkpoint merge by name too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gptoss_cli.checkpoint.storage.dcp_io import SpecReader
from gptoss_cli.checkpoint.formats.hf.layouts import Layout
from gptoss_cli.checkpoint.mapping import Unit, hybrid_shapes, identity, units
from gptoss_cli.checkpoint.storage.safetensors_io import TensorSpec
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.expert_names import expert_name, parse_expert_name
from gptoss_cli.model.lora import ADAPTER, LINEAR_IN, LINEAR_OUT, merged_weight


def adapter_names(name: str) -> tuple[str, str] | None:
    """(A's name, B's name) of the adapter of a Hybrid weight name, by the model's naming (model/lora.py)."""
    per_expert = parse_expert_name(name)
    stack = name if per_expert is None else per_expert.stack
    if not stack.endswith(".weight"):
        return None
    stem = f"{stack.removesuffix('.weight')}.{ADAPTER}"
    pair = f"{stem}.{LINEAR_IN}.weight", f"{stem}.{LINEAR_OUT}.weight"
    return pair if per_expert is None else tuple(expert_name(p, per_expert.expert) for p in pair)


class HfHybridView(SpecReader):
    """An HF or OpenAI-original checkpoint read under Hybrid names through the mapping table (mapping.py)
    and its stored layout (layouts.py), as `gptoss convert` to Hybrid computes them: a read computes its
    table unit (the fused QKV from q/k/v, one expert's fc1 de-interleaved from its gate_up stack, MXFP4
    decoded) and nothing more, so memory stays bounded by one tensor group. MXFP4 experts read as bf16,
    which holds every MXFP4 value exactly; other tensors keep their stored dtype."""

    concurrent_reads = False  # served by the one reader of the source

    def __init__(self, reader, layout: Layout, arch: GptOssArch):
        self.reader, self.layout, self.arch = reader, layout, arch
        self.folder = getattr(reader, "folder", None)
        self._units: dict[str, tuple[Unit, int]] = {}
        self._specs: dict[str, TensorSpec] = {}
        shapes = hybrid_shapes(arch)
        for unit in units(arch):
            stored = layout.stored_names(unit.hf[0])[0]
            dtype = torch.bfloat16 if reader.dtype(stored) == torch.uint8 else reader.dtype(stored)
            for i, name in enumerate(unit.hybrid):
                self._units[name] = unit, i
                self._specs[name] = TensorSpec(name, shapes[name], dtype)

    def close(self) -> None:
        self.reader.close()

    def file_of(self, name: str) -> Path:
        unit, _ = self._units[name]
        return self.reader.file_of(self.layout.stored_names(unit.hf[0])[0])

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        unit, i = self._units[name]
        dtype = self._specs[name].dtype
        if unit.per_expert:  # this expert's slice of the stack, then the table's transform
            (t,) = unit.to_hybrid(self.arch, [self.layout.read(self.reader, self.arch, unit.hf[0], dtype, i, i + 1)])
        elif unit.mapping.to_hybrid is identity:  # one tensor renamed: its rows read as asked
            return self.layout.read(self.reader, self.arch, unit.hf[0], dtype, start, stop)
        else:
            (t,) = unit.to_hybrid(self.arch, [self.layout.read(self.reader, self.arch, n, dtype) for n in unit.hf])
        return t if start is None and stop is None else t[start:stop].contiguous()


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
        a = self._held[pair[0]]
        b = self._held[pair[1]][start:stop]  # rows of the output = rows of B
        self.merged += 1
        return merged_weight(t, a, b, self.scaling)


__all__ = ["HfHybridView", "LoraMergedReader", "adapter_names"]
