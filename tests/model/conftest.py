"""Shared fixtures for the HybridModel tests: a tiny transformers GPT-OSS and an independent,
test-local HF -> Hybrid re-arrangement of its weights (docs/checkpoint-layouts.md)."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.model.config import preset

transformers = pytest.importorskip("transformers")

TINY = preset("tiny")
SEQ = 2 * TINY.sliding_window + 5  # longer than twice the window so window/RoPE bugs show


def tiny_hf_config(**overrides):
    cfg = dict(
        num_hidden_layers=3,
        num_local_experts=4,
        num_experts_per_tok=2,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1003,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0,
        },
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        router_aux_loss_coef=0.9,
        attn_implementation="eager",
        pad_token_id=1001,
        eos_token_id=1002,
    )
    cfg.update(overrides)
    return transformers.GptOssConfig(**cfg)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights at scales that make every part matter: sinks ~ N(0, 1) (so zeroing them shows),
    norms away from 1, biases non-zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "layernorm" in name or name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "router" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="session")
def hf_tiny():
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(tiny_hf_config()).eval()
    randomize_(model)
    return model


def hf_to_hybrid_state_dict(hf_sd: dict, num_layers: int = 3, heads: int = 6, kv: int = 2, hd: int = 16) -> dict:
    """Independent re-arrangement (docs/checkpoint-layouts.md, "Hybrid layout") used as the expectation in tests."""
    r = heads // kv
    out = {
        "embedding.word_embeddings.weight": hf_sd["model.embed_tokens.weight"],
        "decoder.final_norm.weight": hf_sd["model.norm.weight"],
        "output_layer.weight": hf_sd["lm_head.weight"],
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        a = f"decoder.layers.{2 * i}.self_attention."
        m = f"decoder.layers.{2 * i + 1}."
        for kind in ("weight", "bias"):
            q = hf_sd[p + f"self_attn.q_proj.{kind}"]
            k = hf_sd[p + f"self_attn.k_proj.{kind}"]
            v = hf_sd[p + f"self_attn.v_proj.{kind}"]
            rows = []
            for g in range(kv):
                rows += [q[g * r * hd:(g + 1) * r * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
            out[a + f"linear_qkv.{kind}"] = torch.cat(rows)
            out[a + f"linear_proj.{kind}"] = hf_sd[p + f"self_attn.o_proj.{kind}"]
        out[a + "linear_qkv.layer_norm_weight"] = hf_sd[p + "input_layernorm.weight"]
        out[a + "core_attention.softmax_offset"] = hf_sd[p + "self_attn.sinks"]
        out[m + "pre_mlp_layernorm.weight"] = hf_sd[p + "post_attention_layernorm.weight"]
        out[m + "mlp.router.weight"] = hf_sd[p + "mlp.router.weight"]
        out[m + "mlp.router.bias"] = hf_sd[p + "mlp.router.bias"]
        gu = hf_sd[p + "mlp.experts.gate_up_proj"]  # [E, H, 2I], gate/up interleaved on the last dim
        gub = hf_sd[p + "mlp.experts.gate_up_proj_bias"]
        down = hf_sd[p + "mlp.experts.down_proj"]  # [E, I, H]
        downb = hf_sd[p + "mlp.experts.down_proj_bias"]
        for e in range(gu.shape[0]):
            out[m + f"mlp.experts.linear_fc1.weight{e}"] = torch.cat([gu[e][:, 0::2].T, gu[e][:, 1::2].T])
            out[m + f"mlp.experts.linear_fc1.bias{e}"] = torch.cat([gub[e][0::2], gub[e][1::2]])
            out[m + f"mlp.experts.linear_fc2.weight{e}"] = down[e].T
            out[m + f"mlp.experts.linear_fc2.bias{e}"] = downb[e]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def tokens(batch: int = 2, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
