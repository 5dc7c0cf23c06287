"""The row every checkpoint format fills in (`Format`), and the table of them. Torch-free.

A row answers, for one kind of checkpoint folder: is this folder one (`detect`, file checks only),
what model does it hold (`architecture`, without torch: validate-config reads it), how is it
opened as a `Source` (`open`), how `convert --to <name>` writes one (`plan`), and what `--force`
may replace (`replaceable`). `open_source`, `convert`, the model loader and recipe loading ask the
table; nothing else branches on what kind a checkpoint is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from gptoss_cli.model.config import GptOssArch

if TYPE_CHECKING:
    from gptoss_cli.checkpoint.convert_plan import ConvertPlan
    from gptoss_cli.checkpoint.sources import Source

@dataclass(frozen=True)
class OpenOptions:
    """What the caller asked of an opened checkpoint; a row refuses the options it does not take."""

    weights: str | None = None  # training checkpoints: `model` or `master`
    adapters_only: bool = False  # a LoRA training checkpoint read as its adapters alone (`--to peft`)
    arch_from: GptOssArch | None = None  # Megatron checkpoints whose args cannot say the architecture

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in (("weights", self.weights), ("arch_from", self.arch_from)) if v is not None}


@dataclass(frozen=True)
class Format:
    """One kind of checkpoint folder and everything gptoss does with it."""

    name: str  # the kind a Source reports, and the `--to` value of a writable format
    title: str  # how messages name it ("an HF checkpoint")
    detect: Callable[[Path], bool]  # file checks only, no torch
    architecture: Callable[..., tuple[GptOssArch, str | None]]  # (root, options) -> arch, pattern; no torch
    open: Callable[..., "Source"] | None = None  # (src, root, revision, options) -> Source
    plan: Callable[..., "ConvertPlan"] | None = None  # (source, *, experts, dtype, vocab_multiple) -> the writer plan
    replaceable: Callable[[Path], None] | None = None  # --force: raise unless DST is empty or a previous output of ours
    options: frozenset[str] = frozenset()  # the OpenOptions it takes
    writer_options: frozenset[str] = frozenset()  # the convert options its plan takes (experts, vocab_multiple)
    hybrid_named: bool = False  # its tensors carry Hybrid names (no HF layout to go through)
    default_target: str = "hybrid"  # what `convert` writes from it without --to
    same_layout: str | None = None  # the --to that would write its own layout again (refused)
    arch_file: str = "config.json"  # where it records the architecture, for messages
    lora_base: bool = False  # a LoRA run may adapt it (safetensors weights with a fingerprint)
    reads_adapters: bool = False  # `convert --to <name>` reads the source's adapters only

    @property
    def writable(self) -> bool:
        return self.plan is not None

    def __repr__(self) -> str:
        return f"<format {self.name}>"


__all__ = ["Format", "OpenOptions"]
