"""The reference policy of GRPO's KL term: the initial weights.

Under LoRA the reference is the frozen base itself: `adapters_off(model)` takes every adapter out of
its layer for the length of a `with` block (the layers compute without them: model/lora.py looks an
adapter up by attribute) and puts it back, so the reference costs no memory. With full fine-tuning it
is a second, frozen model built by the run's own provider (the same seed or pretrained weights, the
same expert-parallel slice, GEMMs and recompute), whose parameters count once more in the memory
estimate (recipe/estimate/memory_rl.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from gptoss_cli.model.lora import ADAPTER, adapter_modules


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """`model` computing its base (every LoRA adapter detached from its layer) inside the block."""
    taken = []
    for layer_name, adapter in list(adapter_modules(model)):
        layer = model.get_submodule(layer_name)
        taken.append((layer, adapter))
        delattr(layer, ADAPTER)  # as model/lora.py detaches it
    try:
        yield model
    finally:
        for layer, adapter in taken:
            setattr(layer, ADAPTER, adapter)


def frozen_copy(provider, state) -> nn.Module:
    """A second model from the run's provider (the initial policy), frozen, in training mode like the policy."""
    model = provider.provide(state)
    model.requires_grad_(False)
    return model.train()


__all__ = ["adapters_off", "frozen_copy"]
