"""LoRA on a frozen base whose experts stay in MXFP4 (lora.base_experts=mxfp4, model/mxfp4/experts.py).

The reference is the same model with a bf16/fp32 base holding the decoded weights (transformers'
own MXFP4 dequantisation is the reference for the decoded values in tests/checkpoint and
tests/train/test_lora_train.py). Decoding is exact (an E2M1 value times a power of two is a bf16
value), so each GEMM sees bit for bit the same operands: logits and adapter gradients are compared
with zero tolerance, not a rounding bound.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from gptoss_cli.checkpoint.load import model_from_checkpoint
from gptoss_cli.checkpoint.mapping import deinterleave_experts
from gptoss_cli.errors import CheckpointError, ConfigError
from gptoss_cli.fp8.selection import Fp8Settings, select_gemms
from gptoss_cli.model.gemm.grouped import WgradQueue
from gptoss_cli.model.lora import merge_lora_
from gptoss_cli.model.moe import ExpertLinear
from gptoss_cli.model.mxfp4.codec import GROUP, encode, round_to_mxfp4
from gptoss_cli.model.mxfp4.experts import Mxfp4ExpertLinear, expert_storage_bytes
from gptoss_cli.model.mxfp4.qat import qat_gemms
from gptoss_cli.model.recompute_plan import SELECTIVE_MODULES, RecomputePlan
from tests.model.hybrid_helpers import adapted_from
from tests.model.tiny_checkpoints import rewrite_hybrid, write_converted_pair, write_hf_checkpoint


@pytest.fixture(scope="module")
def hf_mxfp4(tmp_path_factory):
    """An HF folder with MXFP4 experts whose groups are not in the floor rule's form: every code's
    magnitude at most 1.5 (mask 0b1011 per nibble), so decoding and re-encoding would change the
    bytes (the scale drops, the codes grow) and only a copy keeps them."""
    from safetensors.torch import load_file, save_file

    folder = write_hf_checkpoint(tmp_path_factory.mktemp("mx-base") / "hf", "mxfp4", seed=7)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_blocks")]:
        tensors[name] = tensors[name] & 0xBB
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _adapted(folder, storage: str, randomize_b: bool = True):
    return adapted_from(folder, randomize_b=randomize_b, base_experts=storage).train()


def _step(model):
    """(logits, adapter gradients) of one batch."""
    vocab = model.arch.vocab_size
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(".adapter." in n for n in grads), sorted(grads)
    return out.logits.detach(), grads


def _assert_bitwise(got, want):
    logits, grads = got
    ref_logits, ref_grads = want
    assert torch.equal(logits, ref_logits)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    assert all(g.abs().sum() > 0 for g in ref_grads.values())


def _experts(model):
    return [layer.mlp.experts for _, layer in model.moe_layers()]


def test_an_hf_mxfp4_base_keeps_its_blocks_and_scales_as_released(hf_mxfp4):
    """Every local expert's blocks and scales are the file's bytes (fc1's rows de-interleaved from HF's
    gate/up alternation, whole rows: a block never moves), never decoded and re-encoded; they decode to
    the weights a bf16-storage load of the same folder holds."""
    mx = model_from_checkpoint(hf_mxfp4, base_experts="mxfp4")
    ref = model_from_checkpoint(hf_mxfp4, dtype=torch.float32)
    with safe_open(str(hf_mxfp4 / "model.safetensors"), "pt") as f:
        for block, (experts, ref_experts) in enumerate(zip(_experts(mx), _experts(ref))):
            for ours, hf in (("linear_fc1", "gate_up_proj"), ("linear_fc2", "down_proj")):
                layer = getattr(experts, ours)
                assert isinstance(layer, Mxfp4ExpertLinear)
                blocks = f.get_tensor(f"model.layers.{block}.mlp.experts.{hf}_blocks")
                scales = f.get_tensor(f"model.layers.{block}.mlp.experts.{hf}_scales")
                if ours == "linear_fc1":
                    blocks, scales = (torch.stack(deinterleave_experts(mx.arch, t)) for t in (blocks, scales))
                assert torch.equal(layer.blocks, blocks) and torch.equal(layer.scales, scales)
                assert torch.equal(layer.decoded_weight(), getattr(ref_experts, ours).weight)
                assert not torch.equal(encode(layer.decoded_weight())[1], layer.scales)  # re-encoding would differ


def test_logits_and_adapter_grads_equal_a_base_holding_the_decoded_weights(hf_mxfp4):
    _assert_bitwise(_step(_adapted(hf_mxfp4, "mxfp4")), _step(_adapted(hf_mxfp4, "bf16")))


@pytest.mark.parametrize("plan", [RecomputePlan(modules=frozenset(SELECTIVE_MODULES)),
                                  RecomputePlan(modules=frozenset({"moe_act", "layernorm"})),
                                  RecomputePlan(full_units=((0, 6),))], ids=["moe", "moe_act", "full"])
def test_recompute_on_an_mxfp4_base_equals_the_bf16_base(hf_mxfp4, plan):
    """Recompute re-runs the frozen GEMMs, which decode again: the same values, the same gradients."""
    ref = _adapted(hf_mxfp4, "bf16")
    mx = _adapted(hf_mxfp4, "mxfp4")
    for m in (ref, mx):
        m.set_recompute(plan)
    _assert_bitwise(_step(mx), _step(ref))


def test_fp8_and_qat_gemms_get_the_decoded_weight(hf_mxfp4):
    """FP8 (emulated) quantises the decoded weight as it would the bf16 base's; MXFP4 QAT's rounding of an
    MXFP4 weight returns it unchanged (B = 0 here, the state every run starts from)."""
    for wrap in ("fp8", "qat"):
        runs = []
        for storage in ("bf16", "mxfp4"):
            model = _adapted(hf_mxfp4, storage, randomize_b=wrap == "fp8")
            if wrap == "fp8":
                gemms = select_gemms(Fp8Settings("tensorwise", "hybrid", emulation=True), "cpu")
                model.set_gemms(dense=gemms.dense, grouped=gemms.grouped)
            else:
                model.set_gemms(grouped=qat_gemms("mxfp4"))
            runs.append(_step(model))
        logits, grads = runs[1]
        assert torch.equal(logits, runs[0][0]), wrap
        assert all(torch.equal(grads[n], g) for n, g in runs[0][1].items()), wrap
    plain = _step(_adapted(hf_mxfp4, "mxfp4", randomize_b=False))
    assert torch.equal(plain[0], logits) and all(torch.equal(plain[1][n], g) for n, g in grads.items())


def test_delayed_wgrad_queues_only_the_adapters_of_an_mxfp4_base(hf_mxfp4):
    """The frozen MXFP4 GEMMs have no wgrad: under delayed wgrad the queue holds the 4 adapter factors'
    GEMMs of fc1 and fc2 and nothing of the base; running it gives plain autograd's gradients, and dx."""
    out = {}
    for storage in ("bf16", "mxfp4"):
        experts = _experts(_adapted(hf_mxfp4, storage))[0]
        tokens = torch.tensor([3, 0, 5, 2])
        x = torch.randn(10, experts.linear_fc1.weight_shape[2], generator=torch.Generator().manual_seed(4))
        dy = torch.randn(10, experts.linear_fc2.weight_shape[1], generator=torch.Generator().manual_seed(6))
        factors = [getattr(getattr(experts, fc).adapter, part).weight
                   for fc in ("linear_fc1", "linear_fc2") for part in ("linear_in", "linear_out")]
        xi = x.clone().requires_grad_(True)
        queue = WgradQueue()
        experts(xi, tokens, wgrad_queue=queue).backward(dy)
        assert len(queue) == 4 and queue.execute() == 4
        queue.finish_step()
        out[storage] = (xi.grad, [p.grad for p in factors])
    assert torch.equal(out["mxfp4"][0], out["bf16"][0])
    assert all(torch.equal(a, b) for a, b in zip(out["mxfp4"][1], out["bf16"][1]))


def test_a_bf16_base_is_quantised_per_expert_as_it_is_read(tmp_path):
    """A base stored in bf16/fp32 (a Hybrid folder, whose expert weights are not MXFP4 values): each
    expert tensor is encoded as it is read (OCP floor rule), so the layer decodes to round_to_mxfp4 of
    the stored weight; a NaN in the base is one CheckpointError naming the tensor."""
    _, hybrid = write_converted_pair(tmp_path, "bf16", seed=4)
    ref = model_from_checkpoint(hybrid, dtype=torch.float32)
    mx = model_from_checkpoint(hybrid, dtype=torch.float32, base_experts="mxfp4")
    for experts, ref_experts in zip(_experts(mx), _experts(ref)):
        for fc in ("linear_fc1", "linear_fc2"):
            w = getattr(ref_experts, fc).weight
            layer = getattr(experts, fc)
            assert not torch.equal(round_to_mxfp4(w), w)  # the stored weights are not on the MXFP4 grid
            blocks, scales = encode(w)
            assert torch.equal(layer.blocks, blocks) and torch.equal(layer.scales, scales)
            assert torch.equal(layer.decoded_weight(), round_to_mxfp4(w))
            assert torch.equal(layer.bias, getattr(ref_experts, fc).bias)  # biases stay in the params dtype

    name = "decoder.layers.1.mlp.experts.linear_fc2.weight2"

    def poison(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][3, 5] = float("nan")

    rewrite_hybrid(hybrid, poison)
    with pytest.raises(CheckpointError, match=rf"tensor {name}: MXFP4 cannot encode nan"):
        model_from_checkpoint(hybrid, dtype=torch.float32, base_experts="mxfp4")


def test_resident_expert_bytes_are_4_25_of_16_of_bf16(hf_mxfp4):
    """The point of the option: the model holds 4.25 bits per expert weight (a 4-bit code, and an 8-bit
    scale per 32) where a bf16 base holds 16; counted from the buffers the model really has."""
    bf16 = model_from_checkpoint(hf_mxfp4, dtype=torch.bfloat16)
    mx = model_from_checkpoint(hf_mxfp4, dtype=torch.bfloat16, base_experts="mxfp4")
    dense, packed = expert_storage_bytes(bf16), expert_storage_bytes(mx)
    assert dense["mxfp4"] == 0 and packed["dense"] == 0
    assert packed["mxfp4"] * 16 == dense["dense"] * (4 + 8 / GROUP)
    held = sum(b.numel() * b.element_size() for n, b in mx.named_buffers() if n.endswith(("blocks", "scales")))
    assert held == packed["mxfp4"]
    assert not any(isinstance(m, ExpertLinear) and not isinstance(m, Mxfp4ExpertLinear) for m in mx.modules())


def test_readers_of_the_missing_weight_are_told_why(hf_mxfp4):
    model = _adapted(hf_mxfp4, "mxfp4")
    fc1 = _experts(model)[0].linear_fc1
    with pytest.raises(AttributeError, match="MXFP4 blocks/scales .*lora.base_experts=mxfp4"):
        fc1.weight
    with pytest.raises(ConfigError, match="keeps these experts in MXFP4") as info:
        merge_lora_(model)
    assert "--to hf" in info.value.hint
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".adapter." not in n)


def test_an_mxfp4_base_under_expert_parallel_holds_its_own_experts(hf_mxfp4):
    """A rank of EP=2 loads experts [2, 4) only, byte for byte the full model's rows 2 and 3."""
    full = model_from_checkpoint(hf_mxfp4, base_experts="mxfp4")
    half = model_from_checkpoint(hf_mxfp4, base_experts="mxfp4", expert_offset=2, num_local_experts=2,
                                 token_dispatcher_factory=lambda j, layer: None)
    for experts, whole in zip(_experts(half), _experts(full)):
        for fc in ("linear_fc1", "linear_fc2"):
            got, want = getattr(experts, fc), getattr(whole, fc)
            assert got.blocks.shape[0] == 2 and torch.equal(got.blocks, want.blocks[2:])
            assert torch.equal(got.scales, want.scales[2:])
