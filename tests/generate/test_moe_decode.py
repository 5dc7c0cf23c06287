"""A decoding step's MoE layer (model/decode/moe.py), on the CPU's per-expert GEMMs and on the grouped
GEMM over device-side counts that accelerators take, equals transformers' MoE half of a block."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.decode.moe import DecodeExperts, decode_moe, decode_moe_available
from tests.model.conftest import TINY, hf_to_hybrid_state_dict
from tests.tolerances import reassociation_rel

# Same weights, fp32 on both sides: the sums differ in order only (the widest is the expert
# intermediate size), through fc1, the activation and fc2.
REL = reassociation_rel(TINY.intermediate_size, depth=2)


@pytest.mark.parametrize("on_host", [True, False], ids=["per-expert-addmm", "grouped-device-counts"])
@pytest.mark.parametrize("rows", [1, 5])
def test_decode_moe_equals_transformers_moe(hf_tiny, on_host, rows):
    ours = HybridModel(TINY).eval()
    ours.load_state_dict(hf_to_hybrid_state_dict(hf_tiny.state_dict()), strict=True)
    layer, hf_layer = ours.decoder.layers[3], hf_tiny.model.layers[1]  # Hybrid layer 2i+1: HF block i's MoE
    assert decode_moe_available(layer)
    experts = DecodeExperts(layer)
    if not on_host:  # the accelerator path, run on the CPU: counts stay tensors, one grouped GEMM per fc
        experts.on_host, experts.fc1, experts.fc2 = False, None, None
    x = torch.randn(rows, 1, TINY.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = x + hf_layer.mlp(hf_layer.post_attention_layernorm(x))[0]
        got = decode_moe(experts, x)
    err = (got - want).abs().max().item()
    assert err <= REL * want.abs().max().item(), f"max |diff| {err:.3g}"
