"""The registry of checkpoint formats: one package and one row (`registry.Format`) per kind of folder.

    hybrid/      gptoss's Hybrid checkpoint (hybrid_config.json)          read, written (--to hybrid)
    hf/          Hugging Face GPT-OSS (config.json, model_type gpt_oss)   read, written (--to hf)
    original/    OpenAI's original/ layout                                read
    megatron/    Megatron-LM torch_dist                                   read, written (--to megatron)
    training/    a `gptoss train` checkpoint (DCP + train_state.json)     read
    peft/        a PEFT LoRA adapter                                      recognised, written (--to peft)
    gguf/        one GGUF file for llama.cpp (gpt-oss architecture)       recognised, written (--to gguf)

A format's package `__init__` is its row; its plan (plan.py, for a format gptoss writes), its
record or config and its readers are modules beside it. Every row answers `registry.Format`; every
plan is a `plan.ConvertPlan`.

`detect` asks each row in `FORMATS` order whether a folder is one of its kind (the first that says
yes owns it: a Megatron iteration folder also holds DCP's `.metadata`, so Megatron comes before
training). Importing this package imports no torch: validate-config detects and reads
architectures with it.
"""

from __future__ import annotations

from pathlib import Path

from gptoss_cli.checkpoint.formats.gguf import GGUF
from gptoss_cli.checkpoint.formats.hf import HF
from gptoss_cli.checkpoint.formats.hybrid import HYBRID
from gptoss_cli.checkpoint.formats.megatron import MEGATRON
from gptoss_cli.checkpoint.formats.original import ORIGINAL
from gptoss_cli.checkpoint.formats.peft import PEFT
from gptoss_cli.checkpoint.formats.registry import Format, OpenOptions
from gptoss_cli.checkpoint.formats.training import TRAINING
from gptoss_cli.errors import CheckpointError, UsageError

FORMATS: tuple[Format, ...] = (HYBRID, HF, ORIGINAL, MEGATRON, TRAINING, PEFT, GGUF)  # detection order
WRITERS: tuple[str, ...] = tuple(f.name for f in FORMATS if f.writable)  # the `convert --to` choices


def detect(root: Path) -> Format | None:
    """The format of checkpoint folder `root`, or None when no row recognises it."""
    for fmt in FORMATS:
        try:
            if fmt.detect(root):
                return fmt
        except OSError:  # an unreadable folder is no checkpoint of this kind
            continue
    return None


def detect_or_fail(root: Path) -> Format:
    fmt = detect(root)
    if fmt is None:
        raise CheckpointError(
            f"{root}: no config.json (HF), original/config.json (OpenAI), hybrid_config.json (Hybrid), "
            "latest / train_state.json (a training checkpoint), latest_checkpointed_iteration.txt (Megatron) "
            "or adapter_config.json (PEFT) found",
            hint="point SRC at the checkpoint folder",
        )
    return fmt


def by_name(name: str) -> Format:
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise UsageError(f"{name!r} is not a checkpoint format ({', '.join(f.name for f in FORMATS)})")


def writer(name: str) -> Format:
    """The row `convert --to name` writes; a UsageError naming the choices otherwise."""
    if name not in WRITERS:
        raise UsageError(f"--to {name!r} is not supported; use {' or '.join(WRITERS)}")
    return by_name(name)


def architecture(root: Path, options: OpenOptions | None = None) -> tuple[Format, tuple]:
    """(format, (architecture, stored layer pattern or None)) of a checkpoint folder, without torch."""
    fmt = detect_or_fail(root)
    return fmt, fmt.architecture(root, options)


__all__ = ["FORMATS", "WRITERS", "Format", "OpenOptions", "detect", "detect_or_fail", "by_name", "writer",
           "architecture", "HF", "HYBRID", "ORIGINAL", "MEGATRON", "TRAINING", "PEFT", "GGUF"]
