"""Weight initialisation: every tensor drawn from its own generator, seeded by (seed, checkpoint name)."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from gptoss_cli.model.expert_names import checkpoint_slots


def name_generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator of the tensor called `name` (its checkpoint name) under `seed`: its values
    depend on nothing else, so any rank or expert slice that holds the tensor draws the same."""
    return torch.Generator().manual_seed((seed * 2_654_435_761 + zlib.crc32(name.encode())) % (1 << 63))


def init_weights_(model: nn.Module, std: float, seed: int) -> None:
    """The one initialisation rule: norm weights 1, biases 0, every other tensor normal(0, std)
    drawn from `name_generator(seed, checkpoint name)`.

    A tensor's value depends only on the seed and its checkpoint name, not on which rank or
    expert slice holds it, so any EP layout starts from the same model."""
    with torch.no_grad():
        for name, dest in checkpoint_slots(model):
            leaf = name.rsplit(".", 1)[-1]
            if ("norm" in name and leaf.startswith("weight")) or leaf == "layer_norm_weight":
                dest.fill_(1.0)
            elif leaf.startswith("bias"):
                dest.zero_()
            else:
                dest.copy_(torch.randn(dest.shape, generator=name_generator(seed, name), dtype=torch.float32).mul_(std))


__all__ = ["init_weights_", "name_generator"]
