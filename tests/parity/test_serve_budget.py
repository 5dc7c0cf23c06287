"""serve-check's budget (parity/serve/budget.py) carried through the checked weights' own layers, without an engine.

The budget is the error model's roundings drawn at every rounding point and carried to the logprobs by
the model itself: it must follow the weights (a grown output layer or sharpened attention, as training
makes them, widens it; the old gain-1 formula did not see attention at all), it must not depend on the
size the draws are made at (the response is linear there, so neither this machine's rounding nor the
draw's size shows), and it is the same every time (seeded draws).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gptoss_cli.model.build import build_model
from gptoss_cli.model.config import preset
from gptoss_cli.model.init import init_weights_
from gptoss_cli.parity.serve import budget
from gptoss_cli.parity.serve.reference import reference_for

IDS = [5, 17, 300, 2, 99, 640, 41, 7, 123, 8, 900, 33]


@pytest.fixture()
def model():
    torch.manual_seed(0)
    m = build_model(dataclasses.replace(preset("tiny"), head_dim=64), dtype=torch.float32).eval()
    init_weights_(m, 0.2, 0)  # activations of unit scale: every sublayer matters
    return m


def _budget(model) -> torch.Tensor:
    return reference_for(model, "p", IDS, greedy_tokens=0, dtype=torch.float32).budget


def test_the_budget_is_the_same_every_run_and_whatever_size_the_draws_are_made_at(model, monkeypatch):
    first = _budget(model)
    assert torch.equal(first, _budget(model))
    monkeypatch.setattr(budget, "INJECTED_FLOOR", 2.0**-16)  # 8x smaller draws, scaled back 8x less
    assert torch.allclose(_budget(model), first, rtol=0.02), (first, _budget(model))
    assert 1e-7 < float(first.max()) < 1e-3  # fp32 roundings: far from 0, far from a layout bug's O(0.1)


def test_the_budget_follows_the_weights_it_checks(model):
    before = _budget(model)
    with torch.no_grad():  # what training can do: sharpen attention's scores, grow the output layer
        for name, p in model.named_parameters():
            if name.endswith("linear_qkv.weight"):
                p.mul_(2.0)
    sharpened = _budget(model)
    with torch.no_grad():
        model.output_layer.weight.mul_(3.0)
    grown = _budget(model)
    assert float(sharpened.max()) > 1.5 * float(before.max()), (before.max(), sharpened.max())
    assert float(grown.max()) > 2.0 * float(sharpened.max()), (sharpened.max(), grown.max())
