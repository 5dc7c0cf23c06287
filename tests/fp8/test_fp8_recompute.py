"""Recompute composes with FP8: the recomputed GEMM inputs are bitwise the originals, so the emulated
FP8 casts use the same scales and the gradients equal those without recompute exactly (fp32 on CPU)."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.fp8.selection import Fp8Settings, select_gemms
from gptoss_cli.model.config import preset
from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.pattern import parse_pattern
from gptoss_cli.model.recompute_plan import RecomputePlan

TINY = preset("tiny").replace(hidden_size=64, intermediate_size=96)


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_fp8_gradients_are_unchanged_by_selective_and_full_recompute(recipe):
    torch.manual_seed(0)
    model = HybridModel(TINY, parse_pattern("*E*-*E"), dtype=torch.float32).train()  # a dense layer for `mlp`
    model.aux_loss_coef = 0.01
    gemms = select_gemms(Fp8Settings(recipe, "hybrid" if recipe == "tensorwise" else "e4m3", emulation=True), "cpu")
    assert model.set_gemms(dense=gemms.dense, grouped=gemms.grouped)
    ids = torch.randint(0, TINY.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))

    def grads(plan: RecomputePlan) -> dict[str, torch.Tensor]:
        model.set_recompute(plan)
        model.zero_grad(set_to_none=True)
        out = model(ids)
        (out.lm_loss_sum(ids) + out.aux_loss).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    base = grads(RecomputePlan())
    layers = len(model.pattern.layers)
    for plan in (RecomputePlan(frozenset({"core_attn", "moe_act", "layernorm"})),
                 RecomputePlan(frozenset({"moe", "mlp", "layernorm"})),
                 RecomputePlan.from_settings("full", (), "uniform", 2, layers)):
        got = grads(plan)
        for name, g in base.items():
            assert torch.equal(got[name], g), (recipe, plan, name)
