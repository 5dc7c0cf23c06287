"""HybridModel computes what transformers' GptOssForCausalLM computes (weights copied by the
test-local re-arrangement in conftest)."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.model.hybrid import HybridModel
from tests.model.conftest import TINY, hf_to_hybrid_state_dict, tokens


def _ours(hf_model, dtype=torch.float32) -> HybridModel:
    model = HybridModel(TINY).eval()
    model.load_state_dict(hf_to_hybrid_state_dict(hf_model.state_dict()), strict=True)
    return model.to(dtype)


def test_logits_match_transformers_fp32(hf_tiny):
    ids = tokens()
    with torch.no_grad():
        expected = hf_tiny(ids).logits
        got = _ours(hf_tiny)(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_logits_close_to_transformers_bf16(hf_tiny):
    ids = tokens()
    with torch.no_grad():
        expected = hf_tiny(ids).logits
        got = _ours(hf_tiny, torch.bfloat16)(ids).logits.float()
    cos = torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0)
    assert cos > 0.999
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def test_lm_loss_matches_transformers_loss(hf_tiny):
    ids = tokens()
    with torch.no_grad():
        expected = hf_tiny(ids, labels=ids).loss  # transformers shifts internally
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        got = _ours(hf_tiny)(ids, labels=labels).lm_loss
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_aux_loss_matches_transformers_load_balancing_loss(hf_tiny):
    from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func

    ids = tokens()
    model = _ours(hf_tiny).train()
    logits = []
    for _, layer in model.moe_layers():
        layer.mlp.router.register_forward_hook(lambda m, i, o: logits.append(o.logits.detach()))
    out = model(ids)
    expected = load_balancing_loss_func(tuple(logits), TINY.num_local_experts, TINY.num_experts_per_tok)
    torch.testing.assert_close(out.aux_loss.detach(), expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        hf_aux = hf_tiny(ids, output_router_logits=True).aux_loss
    torch.testing.assert_close(out.aux_loss.detach(), hf_aux, rtol=1e-4, atol=1e-5)


def test_loss_adds_coef_times_aux_loss_in_training(hf_tiny):
    ids = tokens()
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    out = _ours(hf_tiny).train()(ids, labels=labels)
    torch.testing.assert_close(out.loss, out.lm_loss + TINY.router_aux_loss_coef * out.aux_loss)
    out.loss.backward()


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_match_transformers(truncate):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from gptoss_cli.model.rope import yarn_inv_freq
    from tests.model.conftest import tiny_hf_config

    cfg = tiny_hf_config()
    cfg.rope_parameters["truncate"] = truncate
    expected, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    got, got_scale = yarn_inv_freq(TINY.replace(rope_truncate=truncate))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got_scale == pytest.approx(scale)


def test_yarn_truncate_flag_changes_frequencies():
    from gptoss_cli.model.rope import yarn_inv_freq

    a, _ = yarn_inv_freq(TINY)
    b, _ = yarn_inv_freq(TINY.replace(rope_truncate=True))
    assert not torch.equal(a, b)
