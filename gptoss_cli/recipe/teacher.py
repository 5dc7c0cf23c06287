"""A distillation teacher's architecture as a recipe names it (torch-free: validate-config and the memory estimate).

The teacher of objective.kind=distill has its own architecture (120B teaching 20B): `distill.teacher_preset`
where the recipe names one (the checkpoint need not be at hand to validate), else the config of
`distill.teacher_checkpoint` when it is readable here. `teacher_architecture` returns None when neither is
known: the rules then skip what needs it, and the launch reads the checkpoint itself.
"""

from __future__ import annotations

from pathlib import Path

from gptoss_cli.errors import GptossError
from gptoss_cli.model.config import PRESETS, GptOssArch
from gptoss_cli.model.pattern import HybridPattern, parse_pattern
from gptoss_cli.recipe.schema import RecipeConfig

# the sizes a preset and a checkpoint must agree on to be the same teacher
SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "num_local_experts", "num_experts_per_tok", "vocab_size")


def checkpoint_teacher(path: str) -> tuple[GptOssArch, HybridPattern] | None:
    """The architecture and layer pattern of the checkpoint at `path`, or None when it is not readable here."""
    from gptoss_cli.recipe.load import architecture_from_checkpoint  # noqa: PLC0415

    if not Path(path).expanduser().exists():
        return None
    try:
        arch, stored = architecture_from_checkpoint(path)
    except GptossError:
        return None
    return arch, parse_pattern(stored or arch.hybrid_layer_pattern)


def teacher_architecture(cfg: RecipeConfig) -> tuple[GptOssArch, HybridPattern] | None:
    """(architecture, layer pattern) of the recipe's teacher, or None when neither its preset nor its checkpoint
    is known here (module docstring)."""
    d = cfg.distill
    if d.teacher_preset is not None:
        arch = PRESETS[d.teacher_preset]
        return arch, parse_pattern(arch.hybrid_layer_pattern)
    if d.teacher_checkpoint:
        return checkpoint_teacher(d.teacher_checkpoint)
    return None


def size_mismatch(a: GptOssArch, b: GptOssArch) -> list[tuple[str, int, int]]:
    """(field, a's, b's) of every size in SIZE_FIELDS on which two architectures differ."""
    return [(f, getattr(a, f), getattr(b, f)) for f in SIZE_FIELDS if getattr(a, f) != getattr(b, f)]


__all__ = ["teacher_architecture", "checkpoint_teacher", "size_mismatch", "SIZE_FIELDS"]
