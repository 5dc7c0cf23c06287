"""HybridModel computes what transformers' GptOssForCausalLM computes (weights copied by the
test-local re-arrangement in conftest)."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.model.hybrid import HybridModel
from tests.model.conftest import TINY, hf_to_hybrid_state_dict, randomize_, tiny_hf_config, tokens, transformers


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


@pytest.mark.parametrize("chunk_tokens", [5, 4096], ids=["chunked", "one-chunk"])
def test_lm_loss_matches_transformers_loss(hf_tiny, chunk_tokens):
    ids = tokens()
    with torch.no_grad():
        expected = hf_tiny(ids, labels=ids).loss  # transformers shifts internally
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        model = _ours(hf_tiny)
        model.loss_chunk_tokens = chunk_tokens
        got = model(ids, labels=labels).lm_loss
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


# --- the SwiGLU clamp (docs/architecture.md, "Forward semantics"): weights that make it active ---
CLAMP_SCALE = 15.0  # fc1 weights 15 x 0.08 = 1.2 randn: routed pre-activations have a std of about 10


@pytest.fixture(scope="module")
def hf_clamping():
    """The tiny transformers model with its experts' gate_up weights scaled so that a good part of the
    gate and up pre-activations lies beyond the +-7 clamp (asserted by the tests that use it)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(tiny_hf_config()).eval()
    randomize_(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(CLAMP_SCALE)
    return model


def routed_preactivations(hf_layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) pre-activations of the routed (token, expert) pairs of one transformers MoE block
    for its normed input x [T, H], computed from transformers' own weights and router."""
    experts = hf_layer.mlp.experts
    _, _, idx = hf_layer.mlp.router(x)
    rows = torch.arange(x.shape[0])[:, None].expand_as(idx)
    gu = torch.einsum("th,thf->tf", x[rows.reshape(-1)], experts.gate_up_proj[idx.reshape(-1)])
    gu = gu + experts.gate_up_proj_bias[idx.reshape(-1)]
    return gu[:, 0::2], gu[:, 1::2]  # interleaved (docs/checkpoint-layouts.md, "Hugging Face layout")


def assert_clamp_active(gate: torch.Tensor, up: torch.Tensor) -> None:
    assert (gate > 7).float().mean() > 0.15, "too few gate pre-activations above the clamp"
    assert (up.abs() > 7).float().mean() > 0.3, "too few up pre-activations beyond +-7"


def router_margin(router_logits) -> float:
    """Smallest gap between a token's k-th and (k+1)-th router logit: rounding below it cannot
    change which experts are chosen."""
    gaps = [(l.topk(TINY.num_experts_per_tok + 1, dim=-1).values[:, -2:]).diff(dim=-1).abs().min() for l in router_logits]
    return float(min(gaps))


def test_moe_layer_matches_transformers_where_the_clamp_is_active(hf_clamping):
    """Our E layer (pre-MLP norm, router, experts, residual) against transformers' post-attention
    half of a decoder block, on inputs of unit scale. fp32 on both sides: the results differ only
    by summation order, a relative error of about n * 2**-24 per GEMM (n <= 96 terms), so 1e-5
    relative to the output's scale is a wide bound that a clamp off by any amount would break."""
    hf_layer = hf_clamping.model.layers[1]
    ours = _ours(hf_clamping).decoder.layers[3]  # Hybrid layer 2i+1 is the MoE half of HF block i
    x = torch.randn(2, 24, TINY.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        normed = hf_layer.post_attention_layernorm(x)
        expected = x + hf_layer.mlp(normed)[0]
        got = ours(x)
        assert_clamp_active(*routed_preactivations(hf_layer, normed.reshape(-1, TINY.hidden_size)))
        assert router_margin([hf_layer.mlp.router(normed.reshape(-1, TINY.hidden_size))[0]]) > 1e-3
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


def test_logits_match_transformers_where_the_clamp_is_active(hf_clamping):
    """The whole model, every MoE block clamping. Same fp32 error model as above, accumulated over
    3 blocks of about 6 GEMM-like steps each: 1e-4 relative to the largest logit. The router margin
    (asserted) is orders of magnitude above that, so no expert choice can differ."""
    ids = tokens()
    normed_inputs = []
    hooks = [layer.post_attention_layernorm.register_forward_hook(lambda m, a, o: normed_inputs.append(o))
             for layer in hf_clamping.model.layers]
    try:
        with torch.no_grad():
            expected = hf_clamping(ids, output_router_logits=True)
            got = _ours(hf_clamping)(ids).logits
    finally:
        for h in hooks:
            h.remove()
    for layer, normed in zip(hf_clamping.model.layers, normed_inputs):
        with torch.no_grad():
            assert_clamp_active(*routed_preactivations(layer, normed.reshape(-1, TINY.hidden_size)))
    assert router_margin(expected.router_logits) > 1e-3
    torch.testing.assert_close(got, expected.logits, rtol=0, atol=1e-4 * float(expected.logits.abs().max()))


# --- the training loss: lm + coef * aux, as transformers computes it --------------------------------
@pytest.mark.parametrize("weights", ["hf_tiny", "hf_clamping"])
def test_training_loss_is_transformers_loss_with_router_aux_loss(weights, request):
    """transformers with labels and output_router_logits=True returns lm_loss + router_aux_loss_coef *
    load_balancing_loss: both our model's loss and the training step's per-token loss must equal it."""
    from types import SimpleNamespace

    from gptoss_cli.train.data import Microbatch
    from gptoss_cli.train.objective import forward_step

    hf = request.getfixturevalue(weights)
    ids = tokens()
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    with torch.no_grad():
        expected = hf(ids, labels=ids, output_router_logits=True)  # transformers shifts internally
    model = _ours(hf).train()
    model.config = SimpleNamespace(aux_loss_coeff=TINY.router_aux_loss_coef)  # what the schedule reads
    out = model(ids, labels=labels)
    torch.testing.assert_close(out.aux_loss.detach(), expected.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss.detach(), expected.loss, rtol=1e-5, atol=1e-6)
    output, loss_func = forward_step(iter([Microbatch(tokens=ids, labels=labels)]), model)
    loss_sum, num_tokens, _ = loss_func(output)
    torch.testing.assert_close((loss_sum / num_tokens).detach(), expected.loss, rtol=1e-5, atol=1e-6)


# --- YaRN at the real head_dim 64 -----------------------------------------------------------------
# config.json of openai/gpt-oss-120b as released on the Hub (the fields transformers reads)
RELEASED_120B = {
    "model_type": "gpt_oss", "num_hidden_layers": 36, "num_local_experts": 128, "num_experts_per_tok": 4,
    "experts_per_token": 4, "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 201088, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "initial_context_length": 4096, "rms_norm_eps": 1e-05, "rope_theta": 150000, "swiglu_limit": 7.0,
    "router_aux_loss_coef": 0.9, "attention_bias": True, "tie_word_embeddings": False,
    "eos_token_id": 200002, "pad_token_id": 199999,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
}
# original/config.json of the same model (OpenAI's own layout and names)
OPENAI_120B_ORIGINAL = {
    "num_hidden_layers": 36, "num_experts": 128, "experts_per_token": 4, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "swiglu_limit": 7.0, "head_dim": 64, "num_attention_heads": 64,
    "num_key_value_heads": 8, "sliding_window": 128, "initial_context_length": 4096, "rope_theta": 150000,
    "rope_scaling_factor": 32.0, "rope_ntk_alpha": 1, "rope_ntk_beta": 32,
}


def transformers_yarn(hf_config: dict):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS["yarn"](transformers.GptOssConfig(**hf_config))


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_match_transformers_at_head_dim_64(truncate):
    from gptoss_cli.checkpoint.formats.hf.config import from_hf_config
    from gptoss_cli.model.rope import yarn_inv_freq

    cfg = {**RELEASED_120B, "rope_scaling": {**RELEASED_120B["rope_scaling"], "truncate": truncate}}
    expected, scale = transformers_yarn(cfg)
    got, got_scale = yarn_inv_freq(from_hf_config(cfg))
    assert got.shape == (32,) and torch.equal(got, expected)
    assert got_scale == scale


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_yarn_without_truncate_in_the_config_follows_transformers_default(key):
    """A config.json whose YaRN block has no `truncate` is read by transformers as truncate=True."""
    from gptoss_cli.checkpoint.formats.hf.config import from_hf_config
    from gptoss_cli.model.rope import yarn_inv_freq

    rope = {k: v for k, v in RELEASED_120B["rope_scaling"].items() if k != "truncate"}
    cfg = {k: v for k, v in RELEASED_120B.items() if k != "rope_scaling"}
    cfg[key] = rope if key == "rope_scaling" else {**rope, "rope_theta": cfg.pop("rope_theta")}
    expected, _ = transformers_yarn(cfg)
    got, _ = yarn_inv_freq(from_hf_config(cfg))
    assert torch.equal(got, expected)
    assert not torch.equal(got, transformers_yarn(RELEASED_120B)[0])  # the default is not the released value


# The same YaRN written both ways with every value off the 120B defaults, so a field read from the
# wrong key (or a default standing in for it) shows: original/ -> the HF config.json it means.
OPENAI_OTHER_ROPE = {"rope_theta": 50000, "rope_scaling_factor": 8.0, "initial_context_length": 2048,
                     "rope_ntk_beta": 16, "rope_ntk_alpha": 2}
HF_OTHER_ROPE = {"rope_theta": 50000, "max_position_embeddings": 16384,
                 "rope_scaling": {"beta_fast": 16.0, "beta_slow": 2.0, "factor": 8.0,
                                  "original_max_position_embeddings": 2048, "rope_type": "yarn", "truncate": False}}


@pytest.mark.parametrize("rope", ["released", "other"])
def test_openai_original_config_gives_the_rope_of_the_corresponding_hf_config(rope):
    """original/config.json names YaRN differently (rope_ntk_beta/alpha, initial_context_length,
    rope_scaling_factor) and never rounds the correction range: its frequencies, scale and cos/sin
    must be transformers' for the HF config.json of the same model."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from gptoss_cli.checkpoint.formats.hf.config import from_openai_config
    from gptoss_cli.model.rope import YarnRotaryEmbedding, yarn_inv_freq

    original = {**OPENAI_120B_ORIGINAL, **(OPENAI_OTHER_ROPE if rope == "other" else {})}
    hf_config = {**RELEASED_120B, **(HF_OTHER_ROPE if rope == "other" else {})}
    arch = from_openai_config(original)
    assert arch.max_position_embeddings == hf_config["max_position_embeddings"]
    expected, scale = transformers_yarn(hf_config)
    got, got_scale = yarn_inv_freq(arch)
    assert torch.equal(got, expected) and got_scale == scale
    positions = torch.tensor([[0, 1, 127, 128, 2047, 4096, 16383, 131071]])
    theirs = GptOssRotaryEmbedding(transformers.GptOssConfig(**hf_config))
    ref_cos, ref_sin = theirs(torch.zeros(1, positions.shape[1], 64), positions)  # [1, S, 32]
    cos, sin = YarnRotaryEmbedding(arch)(positions, torch.float32)
    assert ref_cos.shape == cos.shape == (1, 8, 32)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=0)


def test_yarn_truncate_flag_changes_frequencies():
    from gptoss_cli.model.rope import yarn_inv_freq

    a, _ = yarn_inv_freq(TINY)
    b, _ = yarn_inv_freq(TINY.replace(rope_truncate=True))
    assert not torch.equal(a, b)
