"""`ToMegatron`: the conversion plan of `convert --to megatron`: what `ToHybrid` computes, written as
Megatron-LM's `release` (weights without optimizer state) through `MegatronWriter`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch

from gptoss_cli import outputs
from gptoss_cli.checkpoint.formats.hybrid.plan import ToHybrid
from gptoss_cli.checkpoint.formats.megatron.args import megatron_args
from gptoss_cli.checkpoint.formats.megatron.names import DEFAULT_VOCAB_MULTIPLE, RELEASE, TRACKER, padded_vocab
from gptoss_cli.checkpoint.formats.megatron.writer import MegatronWriter, write_folder_files
from gptoss_cli.checkpoint.formats.plan import Empty, fresh


@dataclass
class ToMegatron(ToHybrid):
    """What `ToHybrid` computes, written as Megatron's `release` (weights without optimizer state)."""

    target: ClassVar[str] = "megatron"
    extra_files: ClassVar[tuple[str, ...]] = ()  # Megatron finds its tokenizer by its own options
    vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE

    @classmethod
    def for_source(cls, source, dtype: torch.dtype, vocab_multiple: int | None = None) -> "ToMegatron":
        return super().for_source(source, dtype, vocab_multiple=vocab_multiple or DEFAULT_VOCAB_MULTIPLE)

    @property
    def padded_rows(self) -> int:
        return padded_vocab(self.source.arch.vocab_size, self.vocab_multiple)

    @property
    def total_bytes(self) -> int:  # plus the zero rows of the vocabulary padding
        arch = self.source.arch
        pad = 2 * (self.padded_rows - arch.vocab_size) * arch.hidden_size * torch.empty((), dtype=self.dtype).element_size()
        return super().total_bytes + pad

    def open_writer(self, folder: Path, *, provenance: dict, max_shard_bytes: int,
                    on_bytes: Callable[[int], None] | None):
        return MegatronWriter(folder / RELEASE, self.specs, self.source.arch, padded_rows=self.padded_rows,
                              max_shard_bytes=max_shard_bytes, on_bytes=on_bytes)

    def allocator(self, writer) -> Empty:
        return fresh  # each piece is saved with torch.save, through the page cache

    def write_files(self, folder: Path, provenance: dict) -> None:
        # common.pt keeps the step the source was at
        iteration = self.source.provenance.get("iteration", self.source.provenance.get("megatron_iteration", 0))
        args = megatron_args(self.source.arch, vocab_multiple=self.vocab_multiple, params_dtype=self.dtype)
        write_folder_files(folder / RELEASE, args, iteration, provenance)
        outputs.write_text(folder / TRACKER, RELEASE + "\n")


__all__ = ["ToMegatron"]
