"""A tiny HybridModel and batch, seeded, for tests that compare two ways of running the same model."""

from __future__ import annotations

import torch

from gptoss_cli.model.config import preset
from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.pattern import parse_pattern

TINY = preset("tiny")


def tiny_model(pattern: str = "*E*E*E", aux: float = 0.01, seed: int = 0) -> HybridModel:
    """The tiny preset in `pattern`, initialised from torch's global seed `seed`, in train mode."""
    torch.manual_seed(seed)
    model = HybridModel(TINY, parse_pattern(pattern))
    model.aux_loss_coef = aux
    return model.train()


def tiny_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels) [2, 12], random tokens of the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, TINY.vocab_size, (2, 12), generator=g),
            torch.randint(0, TINY.vocab_size, (2, 12), generator=g))


def adapted_from(folder, *, randomize_b: bool = True, **load) -> HybridModel:
    """The model of a checkpoint folder (fp32; `load` goes to model_from_checkpoint, e.g. base_experts)
    with LoRA rank 4, alpha 8 on all four targets, A seeded by 5 and, with `randomize_b`, B drawn from
    a generator seeded by 5 (a fresh B is zero, and A's gradient with it); aux loss 0.01."""
    from gptoss_cli.checkpoint.load import model_from_checkpoint
    from gptoss_cli.model.lora import TARGET_MODULES, LoraSettings, adapter_modules, attach_lora

    model = model_from_checkpoint(folder, dtype=torch.float32, **load)
    attach_lora(model, LoraSettings(rank=4, alpha=8.0, target_modules=TARGET_MODULES), seed=5)
    if randomize_b:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for _, adapter in adapter_modules(model):
                w = adapter.linear_out.weight
                w.copy_(torch.randn(w.shape, generator=g) * 0.05)
    model.aux_loss_coef = 0.01
    return model
