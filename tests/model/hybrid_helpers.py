"""A tiny HybridModel and batch, seeded, for tests that compare two ways of running the same model."""

from __future__ import annotations

import torch

from gptoss_cli.model.config import preset
from gptoss_cli.model.hybrid import HybridModel

TINY = preset("tiny")


def tiny_model(pattern: str = "*E*E*E", aux: float = 0.01, seed: int = 0) -> HybridModel:
    """The tiny preset in `pattern`, initialised from torch's global seed `seed`, in train mode."""
    torch.manual_seed(seed)
    model = HybridModel(TINY, pattern)
    model.aux_loss_coef = aux
    return model.train()


def tiny_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels) [2, 12], random tokens of the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, TINY.vocab_size, (2, 12), generator=g),
            torch.randint(0, TINY.vocab_size, (2, 12), generator=g))
