"""The memory formulas (gptoss_cli/recipe/estimate/memory.py) against the real model, buffers and autograd."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.model.config import preset
from gptoss_cli.model.expert_names import is_expert_name
from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.loss import LM_LOSS_CHUNK_TOKENS
from gptoss_cli.model.pattern import ATTENTION, MLP, MOE, default_pattern, parse_pattern
from gptoss_cli.parallel.grads import ALIGN, GradAccumulatingModel, GradBufferConfig
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.recipe import load_recipe, validate_recipe
from gptoss_cli.recipe.estimate import memory as M

TINY = preset("tiny")


@pytest.mark.parametrize("pattern,ep", [("*E*E*E", 1), ("*E*-[*E]", 2)], ids=["moe", "dense-mlp-and-ep-slice"])
def test_parameter_layout_is_the_models_named_parameters(pattern, ep):
    n_local = TINY.num_local_experts // ep
    model = HybridModel(TINY, parse_pattern(pattern), expert_offset=0, num_local_experts=n_local, device="meta")
    want = [(n, p.numel(), is_expert_name(n)) for n, p in model.named_parameters()]
    assert [(p.name, p.numel, p.expert) for p in M.parameter_layout(TINY, parse_pattern(pattern), n_local)] == want


@pytest.mark.parametrize("name,total", [("gpt_oss_20b", 20.9e9), ("gpt_oss_120b", 116.8e9)])
def test_parameter_totals_are_the_published_sizes(name, total):
    # docs/architecture.md, "Sizes": 20.9B and 116.8B parameters in total
    arch = preset(name)
    count = sum(p.numel for p in M.parameter_layout(arch, default_pattern(arch)))
    assert round(count / 1e8) == round(total / 1e8)


def test_buffer_layout_equals_the_gradient_buffers():
    model = HybridModel(TINY, device="meta")
    wrapped = GradAccumulatingModel(model, ParallelState(device=torch.device("meta")), GradBufferConfig(bucket_size=20_000))
    layout = M.parameter_layout(TINY, default_pattern(TINY))
    for buf, expert in ((wrapped.grad_buffers.dense, False), (wrapped.grad_buffers.expert, True)):
        numel, buckets = M.buffer_numel([p.numel for p in layout if p.expert == expert], 1, 20_000)
        assert (buf.numel, len(buf.buckets)) == (numel, buckets) and len(buf.buckets) > 1
        assert all(b.numel % ALIGN == 0 for b in buf.buckets)
    assert M.ALIGN == ALIGN


def saved_bytes_per_layer(arch, pattern: str, tokens: int) -> dict[str, int]:
    """Bytes of the tensors autograd saves for backward during one forward in bf16, by the layer that
    saved them (parameters excluded, each storage once); attention's core (SDPA) apart: on the CPU
    it runs the math path, not a fused kernel."""
    torch.manual_seed(0)
    model = HybridModel(arch, parse_pattern(pattern), dtype=torch.bfloat16).train()
    model.aux_loss_coef = 0.01
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, int]] = {}
    label = ["embedding"]

    def enter(name):
        return lambda *_: label.__setitem__(0, name)

    for j, layer in enumerate(model.decoder.layers):
        layer.register_forward_pre_hook(enter(f"{j}{pattern[j]}"))
        if pattern[j] == ATTENTION:
            core = layer.self_attention.core_attention
            core.register_forward_pre_hook(enter("core"))
            core.register_forward_hook(enter(f"{j}{pattern[j]}"))
    model.decoder.final_norm.register_forward_pre_hook(enter("head"))

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen[key] = (label[0], t.untyped_storage().nbytes())
        return t

    ids = torch.randint(0, arch.vocab_size, (2, tokens // 2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids)
        label[0] = "loss"
        loss = out.lm_loss_sum(ids)  # the training path: chunked, gradients computed in forward
    totals: dict[str, int] = {}
    for lab, nbytes in seen.values():
        totals[lab] = totals.get(lab, 0) + nbytes
    # what the chunked loss holds for backward outside autograd's saved tensors (its ctx)
    grad_hidden, grad_weight = loss.grad_fn.grads
    totals["loss.grad_hidden"] = grad_hidden.untyped_storage().nbytes()
    totals["loss.grad_weight"] = grad_weight.untyped_storage().nbytes()
    return totals


def test_activation_formula_equals_what_autograd_saves():
    """Per layer kind, the formula's bytes per token against the measured saved tensors (2%: the
    norms' fp32 weight copies and per-token rms are not in the formula; the second attention layer
    is measured, the first also holds the rotary tables every layer shares). h != I and 8 experts
    so that every term has its own size."""
    arch = TINY.replace(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2)
    tokens = 256
    saved = saved_bytes_per_layer(arch, "*E*-", tokens)
    per = M.activation_bytes_per_token(arch, 2, aux_loss=True)
    attention_outside_core = per[ATTENTION] - M.attention_core_bytes_per_token(arch, 2)
    saved["head"] += saved["loss.grad_hidden"]  # the head's b*h is the gradient the chunked loss holds
    for key, want in (("1E", per[MOE]), ("3-", per[MLP]), ("2*", attention_outside_core), ("head", per["head"])):
        assert saved[key] / tokens == pytest.approx(want, rel=0.02), key
    # the chunked loss holds the output layer's gradient in the params dtype (the formula's b*V*h;
    # its fp32 accumulator lives only during the forward); autograd saves nothing inside it: a
    # chunk's logits and log-softmax (within the per-chunk-token (b + 12)V) are scratch buffers
    # (model/lm_head.py), reused by the next chunk
    assert saved.get("loss", 0) == 0
    assert saved["loss.grad_weight"] == 2 * arch.vocab_size * arch.hidden_size
    assert M.LM_LOSS_CHUNK == LM_LOSS_CHUNK_TOKENS


def test_production_recipe_estimates_by_item():
    """gb200_bf16 (120B, EP=64 on 64 GPUs) in closed form: each rank holds 2 of 128 experts per layer."""
    r = load_recipe("gb200_bf16")
    est = M.estimate_memory(r.config, r.arch, r.pattern, 64)
    arch = r.arch
    h, i, layers = arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers
    experts = layers * 2 * (2 * i * h + 2 * i + h * i + h)  # 2 local experts, fc1 and fc2 with biases
    assert est.bytes_of("params") == pytest.approx(2 * (2_127_589_376 + experts), rel=1e-4)
    assert est.bytes_of("optimizer.expert") == pytest.approx(12 * experts, rel=1e-4)  # expert-DP 1: not sharded
    assert est.bytes_of("optimizer.dense") == pytest.approx(12 * 2_127_589_376 / 64, rel=1e-4)
    assert est.fraction == pytest.approx(est.total_bytes / 186e9)


NO_RECOMPUTE = ["recompute.recompute_granularity=none", "recompute.recompute_modules=[]",
                "optimizer.grad_reduce_in_fp32=true"]


def test_h100_bf16_fits_by_its_own_estimate_and_would_not_without_its_levers():
    report = validate_recipe(load_recipe("h100_bf16"))
    assert report.ok and not [f for f in report.findings if f.rule == "memory.fits"]
    assert report.memory.fraction < M.WARN_FRACTION
    plain = load_recipe("h100_bf16", NO_RECOMPUTE)
    without = M.estimate_memory(plain.config, plain.arch, plain.pattern, 64)
    assert without.total_bytes > 80e9 > report.memory.total_bytes


def test_validate_reports_the_estimate_and_rejects_a_recipe_that_does_not_fit():
    report = validate_recipe(load_recipe("h100_bf16", NO_RECOMPUTE))
    (finding,) = [f for f in report.errors if f.rule == "memory.fits"]
    assert "H100's 80 GB" in finding.message and "activations, MoE layers" in finding.message
    assert "training.micro_batch_size" in finding.hint and "expert_model_parallel_size" in finding.hint
    data = report.to_dict()["memory"]
    assert data["capacity_gb"] == 80 and data["total_gb"] > 80
    assert {it["key"] for it in data["items"]} >= {"params", "grads", "optimizer.dense", "optimizer.expert",
                                                    "activations.moe", "activations.logits"}


def test_between_90_and_100_percent_is_a_warning():
    # a GPU whose memory is the estimate / 0.95 (95% used) warns; one at / 0.85 does not
    r = load_recipe("gb200_bf16")
    total_gb = M.estimate_memory(r.config, r.arch, r.pattern, 64).total_bytes / 1e9
    for name, used, want in (("test95", 0.95, "warning"), ("test85", 0.85, None)):
        M.GPU_MEMORY_GB[name] = total_gb / used
        try:
            report = validate_recipe(r, gpu=name)
        finally:
            del M.GPU_MEMORY_GB[name]
        severities = [f.severity for f in report.findings if f.rule == "memory.fits"]
        assert severities == ([want] if want else []) and report.ok, name


def test_unknown_gpu_gets_the_estimate_but_no_verdict():
    report = validate_recipe(load_recipe("gpt_oss_120b_pretrain"))  # system.gpu: auto
    assert report.memory is not None and report.memory.capacity_bytes is None
    assert not [f for f in report.findings if f.rule == "memory.fits"]


def test_validation_estimates_once_and_reports_the_object_the_rule_judged(monkeypatch):
    from gptoss_cli.recipe.rules import core

    seen = []

    def counting(*args, **kwargs):
        seen.append(M.estimate_memory(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(core, "estimate_memory", counting)
    report = validate_recipe(load_recipe("h100_bf16", NO_RECOMPUTE))
    assert len(seen) == 1 and report.memory is seen[0]
    assert [f.rule for f in report.errors if f.rule == "memory.fits"] == ["memory.fits"]


def test_a_failing_estimate_leaves_no_memory_and_surfaces_as_the_rules_crash(monkeypatch):
    from gptoss_cli.recipe.rules import core

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(core, "estimate_memory", broken)
    report = validate_recipe(load_recipe("h100_bf16", NO_RECOMPUTE))
    assert report.memory is None
    (finding,) = [f for f in report.findings if f.rule == "memory.fits"]
    assert finding.message == "rule crashed: ZeroDivisionError: division by zero"


RECOMPUTE_SETTINGS = {
    "none": [],
    "selective": ["recompute.recompute_granularity=selective", "recompute.recompute_modules=[core_attn,moe_act,layernorm]"],
    "selective_moe": ["recompute.recompute_granularity=selective", "recompute.recompute_modules=[moe,layernorm]"],
    "full_uniform": ["recompute.recompute_granularity=full", "recompute.recompute_method=uniform",
                     "recompute.recompute_num_layers=2"],
    "full_block": ["recompute.recompute_granularity=full", "recompute.recompute_method=block",
                   "recompute.recompute_num_layers=1"],
}


@pytest.mark.parametrize("setting", sorted(RECOMPUTE_SETTINGS))
def test_activations_held_for_backward_match_the_estimate_for_each_recompute_setting(setting, monkeypatch):
    """The live memory after one bf16 forward (every storage an op created that is still alive: what
    autograd and the recompute checkpoints hold for backward, tests/recipe/live_bytes.py) is within
    15% of the estimate's activations that outlive the forward: the layers, the head, full
    recompute's unit inputs and the output layer's gradient the chunked loss holds (b*V*h).
    Full causal attention layers, so the CPU runs SDPA's fused kernel as the formula assumes. The
    estimate is a GPU's, where the LM head's chunk buffers are fresh tensors (model/workspace.py), not
    kept as on the CPU: measured so here too."""
    import gc

    from gptoss_cli.model.workspace import BUFFERS_ENV

    monkeypatch.setenv(BUFFERS_ENV, "fresh")

    from tests.recipe.live_bytes import LiveBytes

    arch = TINY.replace(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                        layer_types=("full_attention", "full_attention"))
    tokens = 256
    small = ["parallelism.world_size=1", "parallelism.expert_model_parallel_size=1", "moe.aux_loss_coeff=0.01",
             "training.micro_batch_size=2", f"training.seq_length={tokens // 2}"]
    cfg = load_recipe("tiny_cpu_ep2", [*small, *RECOMPUTE_SETTINGS[setting]]).config
    est = M.estimate_memory(cfg, arch, parse_pattern("*E*E"), 1)
    torch.manual_seed(0)
    model = HybridModel(arch, parse_pattern("*E*E"), dtype=torch.bfloat16).train()
    model.aux_loss_coef = 0.01
    model.set_recompute(M.recompute_plan(cfg, model.pattern))
    ids = torch.randint(0, arch.vocab_size, (2, tokens // 2))
    with LiveBytes() as live:
        out = model(ids)
        loss = out.lm_loss_sum(ids) + out.aux_loss
        del out
        gc.collect()
        held = live.current
        loss.backward()

    def outliving(estimate):
        return sum(it.bytes for it in estimate.items if it.key.startswith("activations.")
                   and it.key not in ("activations.logits", "activations.recompute_unit"))

    want = outliving(est) + 2 * arch.vocab_size * arch.hidden_size
    assert held == pytest.approx(want, rel=0.15), (setting, [(it.key, it.bytes) for it in est.items])
    if setting != "none":  # and recompute really holds less than the no-recompute estimate
        assert outliving(est) < outliving(M.estimate_memory(load_recipe("tiny_cpu_ep2", small).config, arch, parse_pattern("*E*E"), 1))
