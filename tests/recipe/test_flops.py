"""Model FLOPs per token (gptoss_cli/recipe/estimate/flops.py): hand-derived 20B and 120B numbers, transformers'
own parameter shapes as the independent count of active matmul parameters, a brute-force count of the
keys each query sees, and validate-config --json carrying the number."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from gptoss_cli.cli import app
from gptoss_cli.checkpoint.formats.hf.config import to_hf_config
from gptoss_cli.model.config import PRESETS
from gptoss_cli.model.pattern import parse_pattern
from gptoss_cli.recipe.estimate.flops import (
    average_keys_per_query, count_flops, model_flops_per_token, peak_tflops, recompute_flops_per_token, throughput,
)


def test_120b_and_20b_by_hand():
    # 120B, per HF block: QKV 2880 x (64 + 2x8) x 64 = 14,745,600; output projection 64 x 64 x 2880
    # = 11,796,480; router 2880 x 128 = 368,640; 4 experts x (fc1 2880 x 5760 + fc2 2880 x 2880)
    # = 99,532,800; sum 126,443,520; x 36 blocks = 4,551,966,720; + LM head 201,088 x 2880 =
    # 579,133,440 -> 5,131,100,160 active matmul parameters (about 5.13 B).
    big = count_flops(PRESETS["gpt_oss_120b"], 4096)
    assert big.matmul_params == 5_131_100_160
    # Attention at 4096 tokens: 12 x 64 heads x 64 = 49,152 FLOPs per key; full layers see
    # (4096 + 1) / 2 = 2048.5 keys on average, sliding ones (128 x 129 / 2 + 3968 x 128) / 4096
    # = 126.015625; 18 layers of each: 49,152 x 18 x (2048.5 + 126.015625) = 1,923,872,256.
    assert big.attention == 1_923_872_256
    assert big.model_flops_per_token == 6 * 5_131_100_160 + 1_923_872_256 == 32_710_473_216
    # 20B: router 2880 x 32 = 92,160 -> 126,167,040 per block x 24 + 579,133,440 = 3,607,142,400;
    # attention 49,152 x 12 x 2174.515625 = 1,282,581,504.
    small = count_flops(PRESETS["gpt_oss_20b"], 4096)
    assert small.matmul_params == 3_607_142_400
    assert small.model_flops_per_token == 6 * 3_607_142_400 + 1_282_581_504


def test_each_hf_block_counts_once_whatever_the_layout():
    # The *E split must not double the count (Megatron-Bridge's issue #4508): the grouped [*E]
    # form and the default *E give the same number, and it is the HF per-block number.
    arch = PRESETS["gpt_oss_120b"]
    assert model_flops_per_token(arch, 4096, parse_pattern("*E" * 36)) == model_flops_per_token(
        arch, 4096, parse_pattern("[*E]" * 36))


@pytest.mark.parametrize("preset", ["tiny", "gpt_oss_20b", "gpt_oss_120b"])
def test_active_matmul_parameters_match_transformers_shapes(preset):
    # transformers' GptOssForCausalLM on the meta device: the matmul weights one token uses
    # (q/k/v/o, router, top-k experts' gate_up and down, lm_head).
    from transformers import GptOssConfig, GptOssForCausalLM

    arch = PRESETS[preset]
    cfg = GptOssConfig(**{**to_hf_config(arch), "quantization_config": None})
    with torch.device("meta"):
        hf = GptOssForCausalLM(cfg)
    n = hf.lm_head.weight.numel()
    for layer in hf.model.layers:
        a, m = layer.self_attn, layer.mlp
        n += sum(p.weight.numel() for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj)) + m.router.weight.numel()
        n += arch.num_experts_per_tok * (m.experts.gate_up_proj[0].numel() + m.experts.down_proj[0].numel())
    assert count_flops(arch, 64).matmul_params == n


@pytest.mark.parametrize("seq,window", [(1, None), (7, None), (7, 3), (3, 8), (200, 128), (128, 128)])
def test_average_keys_per_query_is_the_mask_count(seq, window):
    visible = sum(1 for q in range(seq) for k in range(seq) if k <= q and (window is None or k > q - window))
    assert average_keys_per_query(seq, window) == pytest.approx(visible / seq, rel=1e-12)


def test_recompute_flops_are_extra_forward_work_not_model_flops():
    arch = PRESETS["gpt_oss_120b"]
    base = count_flops(arch, 4096)
    layers = len(arch.hybrid_layer_pattern)
    # Full recompute of every layer repeats the forward: 2 x the layers' matmul parameters (not the
    # LM head) + the forward of attention (a third of the 12x).
    full = recompute_flops_per_token(arch, 4096, None, {j: {"layer"} for j in range(layers)})
    head = arch.vocab_size * arch.hidden_size
    assert full == pytest.approx(2 * (base.matmul_params - head) + base.attention / 3, rel=1e-12)
    core = recompute_flops_per_token(arch, 4096, None, {j: {"core_attn", "moe_act", "layernorm"} for j in range(layers)})
    assert core == pytest.approx(base.attention / 3, rel=1e-12)
    assert model_flops_per_token(arch, 4096) == base.model_flops_per_token  # unchanged by any of it


def test_mfu_against_the_gpu_peak():
    assert peak_tflops("h100", fp8=False) == 989.0 and peak_tflops("h100", fp8=True) == 1979.0
    assert peak_tflops("a100", fp8=True) is None and peak_tflops("none", fp8=False) is None
    # 5,900 tokens/s/GPU on 64 H100 (Megatron-Bridge's 120B number) is about 19.5% MFU by this count.
    tflops, mfu = throughput(32_710_473_216, 5900 * 64, 64, peak_tflops("h100", fp8=False))
    assert tflops == pytest.approx(192.99, abs=0.01) and mfu == pytest.approx(0.1951, abs=1e-4)


def test_validate_config_json_carries_model_flops_per_token(tmp_path):
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["validate-config", "gb200_bf16", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["model_flops_per_token"] == 32_710_473_216
    assert "32.71 GFLOP" in result.output


def test_validate_reports_recompute_work_as_hardware_flops_apart():
    from gptoss_cli.recipe import load_and_validate

    _, plain = load_and_validate("h100_bf16")  # moe_act + layernorm: elementwise, no FLOPs counted
    assert plain.to_dict()["hardware_flops_per_token"] == plain.to_dict()["model_flops_per_token"]
    _, moe = load_and_validate("h100_bf16", ["recompute.recompute_modules=[moe,layernorm]"])
    # the experts' forward again: 36 MoE layers x 4 experts x 2 x (fc1 2880 x 5760 + fc2 2880 x 2880)
    extra = 36 * 4 * 2 * 3 * 2880 * 2880
    assert moe.to_dict()["hardware_flops_per_token"] == moe.to_dict()["model_flops_per_token"] + extra
    assert moe.to_dict()["model_flops_per_token"] == 32_710_473_216


@pytest.mark.parametrize("layer_types", [("full_attention", "sliding_attention", "sliding_attention", "full_attention",
                                          "full_attention"),
                                         ("sliding_attention", "full_attention", "full_attention", "full_attention",
                                          "sliding_attention")])
def test_each_attention_layer_gets_its_own_blocks_window_by_value(layer_types):
    """Per attention layer, the core's forward FLOPs against a brute-force mask count with the window
    transformers' config gives that block (`layer_types[i]`): layouts no shift or rotation of the
    block index maps onto themselves, so reading block i +- 1 changes a value, not only the total."""
    from transformers import GptOssConfig

    arch = PRESETS["tiny"].replace(num_hidden_layers=5, layer_types=layer_types)
    hf = GptOssConfig(**{**to_hf_config(arch), "quantization_config": None})
    seq = 3 * arch.sliding_window + 1
    want = []
    for kind in hf.layer_types:
        window = hf.sliding_window if kind == "sliding_attention" else None
        visible = sum(1 for q in range(seq) for k in range(q + 1) if window is None or k > q - window)
        want.append(4 * arch.num_attention_heads * arch.head_dim * visible / seq)
    for pattern in ("*E" * 5, "[*E]" * 5, "*-" * 5):
        got = count_flops(arch, seq, parse_pattern(pattern)).attention_layers
        assert got == pytest.approx(want, rel=1e-12), pattern
