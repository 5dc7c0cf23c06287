"""HF -> Hybrid: names, shapes and values against expectations computed here from the HF tensors.

The expectations re-derive the Megatron layout element by element (docs/checkpoint-layouts.md)
rather than calling the mapping table, so a wrong table fails these tests.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from gptoss_cli.model.config import preset

TINY = preset("tiny")
H, I, E = TINY.hidden_size, TINY.intermediate_size, TINY.num_local_experts
HEADS, KV, D = TINY.num_attention_heads, TINY.num_key_value_heads, TINY.head_dim


def load_all(folder) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for f in files:
        with safe_open(str(folder / f), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def expected_qkv(q, k, v):
    """Per kv group g: q heads g*r..g*r+r-1, then k_g, then v_g (row blocks of head_dim)."""
    r = HEADS // KV
    rows = []
    for g in range(KV):
        for h in range(g * r, (g + 1) * r):
            rows.append(q[h * D:(h + 1) * D])
        rows.append(k[g * D:(g + 1) * D])
        rows.append(v[g * D:(g + 1) * D])
    return torch.cat(rows)


def test_hybrid_folder_has_config_index_and_megatron_names(hybrid_from_bf16):
    cfg = json.loads((hybrid_from_bf16 / "hybrid_config.json").read_text())
    assert cfg["hybrid_layer_pattern"] == "*E" * TINY.num_hidden_layers
    assert cfg["format_version"] == 1
    assert cfg["architecture"]["intermediate_size"] == I
    assert cfg["provenance"]["experts_form"] == "bf16" and cfg["provenance"]["source_format"] == "hf"
    names = set(load_all(hybrid_from_bf16))
    assert "decoder.final_norm.weight" in names and "output_layer.weight" in names
    assert "embedding.word_embeddings.weight" in names
    for i in range(TINY.num_hidden_layers):
        a, m = 2 * i, 2 * i + 1
        assert f"decoder.layers.{a}.self_attention.linear_qkv.weight" in names
        assert f"decoder.layers.{a}.self_attention.core_attention.softmax_offset" in names
        assert f"decoder.layers.{m}.pre_mlp_layernorm.weight" in names
        for e in range(E):
            assert f"decoder.layers.{m}.mlp.experts.linear_fc1.weight{e}" in names
            assert f"decoder.layers.{m}.mlp.experts.linear_fc2.bias{e}" in names
        assert not any(n.startswith(f"decoder.layers.{a}.mlp") for n in names)
    index = json.loads((hybrid_from_bf16 / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == names


@pytest.mark.parametrize("form", ["bf16", "mxfp4"])
def test_values_follow_the_megatron_layout(form, hf_bf16, hf_mxfp4, hybrid_from_bf16, hybrid_from_mxfp4):
    hf_dir, hyb_dir = (hf_bf16, hybrid_from_bf16) if form == "bf16" else (hf_mxfp4, hybrid_from_mxfp4)
    hf, hyb = load_all(hf_dir), load_all(hyb_dir)
    if form == "mxfp4":  # expected expert values come from transformers' own dequantizer
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        for i in range(TINY.num_hidden_layers):
            p = f"model.layers.{i}.mlp.experts."
            for w in ("gate_up_proj", "down_proj"):
                hf[p + w] = convert_moe_packed_tensors(hf[p + w + "_blocks"], hf[p + w + "_scales"], dtype=torch.float32)
    for i in range(TINY.num_hidden_layers):
        p, a, m = f"model.layers.{i}.", f"decoder.layers.{2 * i}.", f"decoder.layers.{2 * i + 1}."
        for kind in ("weight", "bias"):
            q, k, v = (hf[p + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
            assert torch.equal(hyb[a + f"self_attention.linear_qkv.{kind}"], expected_qkv(q, k, v))
        assert torch.equal(hyb[a + "self_attention.linear_qkv.layer_norm_weight"], hf[p + "input_layernorm.weight"])
        assert torch.equal(hyb[a + "self_attention.linear_proj.weight"], hf[p + "self_attn.o_proj.weight"])
        assert torch.equal(hyb[a + "self_attention.core_attention.softmax_offset"], hf[p + "self_attn.sinks"])
        assert torch.equal(hyb[m + "pre_mlp_layernorm.weight"], hf[p + "post_attention_layernorm.weight"])
        assert torch.equal(hyb[m + "mlp.router.bias"], hf[p + "mlp.router.bias"])
        gate_up, gate_up_b = hf[p + "mlp.experts.gate_up_proj"], hf[p + "mlp.experts.gate_up_proj_bias"]
        down, down_b = hf[p + "mlp.experts.down_proj"], hf[p + "mlp.experts.down_proj_bias"]
        for e in range(E):
            fc1 = hyb[m + f"mlp.experts.linear_fc1.weight{e}"]
            fc1_b = hyb[m + f"mlp.experts.linear_fc1.bias{e}"]
            assert fc1.shape == (2 * I, H)
            for j in (0, 1, I // 2, I - 1):  # gate unit j is HF column 2j, up unit j is column 2j+1
                assert torch.equal(fc1[j], gate_up[e][:, 2 * j])
                assert torch.equal(fc1[I + j], gate_up[e][:, 2 * j + 1])
                assert fc1_b[j] == gate_up_b[e][2 * j] and fc1_b[I + j] == gate_up_b[e][2 * j + 1]
            fc2 = hyb[m + f"mlp.experts.linear_fc2.weight{e}"]
            assert fc2.shape == (H, I)
            assert torch.equal(fc2, down[e].T)  # HF down_proj is [I, H], used as x @ W
            assert torch.equal(hyb[m + f"mlp.experts.linear_fc2.bias{e}"], down_b[e])
    assert torch.equal(hyb["decoder.final_norm.weight"], hf["model.norm.weight"])
    assert torch.equal(hyb["output_layer.weight"], hf["lm_head.weight"])
    assert torch.equal(hyb["embedding.word_embeddings.weight"], hf["model.embed_tokens.weight"])


def test_bf16_dtype_option_casts_everything(hf_bf16, tmp_path):
    from gptoss_cli.checkpoint.convert import convert

    convert(str(hf_bf16), tmp_path / "h", dtype="bfloat16")
    hyb = load_all(tmp_path / "h")
    assert {t.dtype for t in hyb.values()} == {torch.bfloat16}
    hf = load_all(hf_bf16)
    assert torch.equal(hyb["output_layer.weight"], hf["lm_head.weight"].to(torch.bfloat16))
