"""The router statistics a training forward returns, against independent references: the expert
counts and entropy of transformers' GptOssTopKRouter on the same batch, Megatron's z_loss_func,
and the same statistics through the overlap schedule's plan."""

from __future__ import annotations

import math

import pytest
import torch

from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.router_stats import ENTROPY_COL, TOKENS_COL
from tests.model.conftest import TINY, hf_to_hybrid_state_dict, tokens
from tests.model.hybrid_helpers import tiny_batch, tiny_model
from tests.tolerances import reassociation_rel


def _ours(hf_model, aux: float = 0.0, z: float = 0.0) -> HybridModel:
    model = HybridModel(TINY)
    model.load_state_dict(hf_to_hybrid_state_dict(hf_model.state_dict()), strict=True)
    model.aux_loss_coef, model.z_loss_coef = aux, z
    return model.train()


def _hf_router_outputs(hf_model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(router logits [T, E], selected expert ids [T, k]) of every transformers MoE layer."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, i, o: seen.append((o[0].detach(), o[2].detach())))
             for layer in hf_model.model.layers]
    try:
        with torch.no_grad():
            hf_model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_expert_load_and_entropy_equal_transformers_router(hf_tiny):
    ids = tokens()
    hf = _hf_router_outputs(hf_tiny, ids)
    table = _ours(hf_tiny)(ids).router_table
    e = TINY.num_local_experts
    assert table.shape == (TINY.num_hidden_layers, e + 2)
    for layer, (logits, indices) in enumerate(hf):
        expected_load = torch.bincount(indices.reshape(-1), minlength=e).double()
        assert torch.equal(table[layer, :e], expected_load), layer
        assert table[layer, :e].sum() == ids.numel() * TINY.num_experts_per_tok
        assert table[layer, TOKENS_COL] == ids.numel()
        p = torch.softmax(logits.double(), dim=-1)
        expected_entropy = -(p * p.log()).sum()
        # fp32 softmax of E logits against float64: a few ulps per token, summed over T tokens
        rel = reassociation_rel(ids.numel() * e)
        assert abs(table[layer, ENTROPY_COL] - expected_entropy) <= rel * expected_entropy, layer
        assert 0 < expected_entropy / ids.numel() <= math.log(e)


def test_z_loss_equals_megatron_z_loss_func(hf_tiny):
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    ids = tokens()
    hf = _hf_router_outputs(hf_tiny, ids)
    out = _ours(hf_tiny, z=1e-3)(ids, labels=ids)
    # Megatron adds each layer's z_loss_func(logits, coeff) to the loss; ours is the sum, unscaled.
    expected = sum(moe_utils.z_loss_func(logits, 1.0) for logits, _ in hf)
    torch.testing.assert_close(out.z_loss.detach(), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(out.loss.detach(), (out.lm_loss + 1e-3 * out.z_loss).detach())


def test_z_loss_gradient_reaches_the_router_only_when_on():
    ids, labels = tiny_batch()
    grads = {}
    for z in (0.0, 1.0):
        model = tiny_model(aux=0.0)
        model.z_loss_coef = z
        out = model(ids, labels=labels)
        out.loss.backward()
        grads[z] = model.decoder.layers[1].mlp.router.weight.grad.clone()
        assert (out.z_loss is None) == (z == 0.0)
    assert not torch.allclose(grads[0.0], grads[1.0])


def test_eval_forward_returns_no_router_statistics(hf_tiny):
    model = _ours(hf_tiny, aux=0.01, z=0.01).eval()
    out = model(tokens())
    assert out.router_table is None and out.aux_loss is None and out.z_loss is None


@pytest.mark.parametrize("aux,z", [(0.0, 0.0), (0.01, 1e-3), (0.0, 1.0)])
def test_schedule_plan_returns_the_forwards_router_statistics_and_gradients(aux, z):
    """The overlap schedule's plan carries the statistics from pre_dispatch nodes to `post`: the
    same router table and loss terms, and the z-loss gradient reaches the routers through it."""
    ids, labels = tiny_batch()
    model = tiny_model(aux=aux)
    model.z_loss_coef = z
    expected = model(ids, labels=labels)
    expected.loss.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if "router" in n}
    model.zero_grad(set_to_none=True)
    plan = model.build_schedule_plan(ids, labels=labels)
    result = plan.forward()
    got = result["extra"]
    assert torch.equal(got.router_table, expected.router_table)
    for name in ("aux_loss", "z_loss"):
        want = getattr(expected, name)
        assert (getattr(got, name) is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(getattr(got, name).detach(), want.detach(), rtol=1e-6, atol=0)
    plan.backward()
    for n, p in model.named_parameters():
        if n in want_grads:
            torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-5, atol=1e-7, msg=n)
