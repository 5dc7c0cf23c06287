"""LoRA composes with what the base model gained beside it: packed documents (cu_seqlens), activation
recompute (selective and full, also under MXFP4 QAT), router telemetry and the aux loss, and MXFP4
QAT, which rounds the merged expert weights."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.model.gemm.grouped import WgradQueue
from gptoss_cli.model.lora import is_adapter_name, merge_lora_
from gptoss_cli.model.moe import ExpertLinear
from gptoss_cli.model.mxfp4.qat import qat_gemms
from gptoss_cli.model.recompute_plan import SELECTIVE_MODULES, RecomputePlan
from tests.model.hybrid_helpers import adapted_from
from tests.model.tiny_checkpoints import write_converted_pair
from tests.tolerances import reassociation_rel

CU = (0, 5, 12, 16, 23, 32)  # documents over 2 rows of 16 tokens (each row start is an offset)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return write_converted_pair(tmp_path_factory.mktemp("lora-compose"), "bf16", seed=3)[1]


def _adapted(hybrid):
    return adapted_from(hybrid)


def _step(model):
    """(loss, router table, adapter gradients) of one packed batch."""
    vocab = model.arch.vocab_size
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=labels, cu_seqlens=CU)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(is_adapter_name(n) for n in grads), sorted(grads)  # the base stays frozen
    return out.loss.detach(), out.router_table, grads


@pytest.mark.parametrize("qat", ["none", "mxfp4"])
def test_lora_with_packed_documents_and_recompute_equals_without_recompute(hybrid, qat):
    model = _adapted(hybrid)
    model.set_gemms(grouped=qat_gemms(qat))
    ref_loss, table, ref = _step(model)
    assert table is not None  # router telemetry still comes back from the adapted MoE layers
    assert all(g.abs().sum() > 0 for g in ref.values())
    n = len(model.decoder.layers)
    for plan in (RecomputePlan(modules=frozenset(SELECTIVE_MODULES)),
                 RecomputePlan(modules=frozenset({"layernorm", "moe_act", "core_attn"})),
                 RecomputePlan(full_units=((0, n),))):
        model.set_recompute(plan)
        loss, _, grads = _step(model)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        for name in ref:
            torch.testing.assert_close(grads[name], ref[name], rtol=1e-6, atol=1e-7, msg=f"{plan}: {name}")


def test_lora_under_mxfp4_qat_computes_the_merged_rounded_model(hybrid):
    """With adapters, QAT rounds the merged expert weights: the adapted QAT model gives the logits of a
    plain model holding W + s B A with the experts rounded by torchao (the merged MXFP4 export), not
    those of the rounded base plus unrounded adapters (the behaviour before)."""
    from tests.model.test_lora_qat import torchao_round

    qat = _adapted(hybrid)
    qat.set_gemms(grouped=qat_gemms("mxfp4"))
    merged, base_only = _adapted(hybrid), _adapted(hybrid)
    merge_lora_(merged)
    with torch.no_grad():
        for model in (merged, base_only):
            for m in model.modules():
                if isinstance(m, ExpertLinear):
                    m.weight.copy_(torchao_round(m.weight))
    ids = torch.randint(0, qat.arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want, before = (m.eval()(ids).logits for m in (qat, merged, base_only))
    arch = qat.arch
    # the attention adapters add their path separately in one model and merged in the other
    rel = reassociation_rel(max(arch.hidden_size, arch.intermediate_size), depth=4 * arch.num_hidden_layers)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= rel * scale
    assert (before - want).abs().max().item() > 100 * rel * scale


@pytest.mark.parametrize("qat", ["none", "mxfp4"])
@pytest.mark.parametrize("input_grad", [True, False])
def test_expert_adapters_weight_gradients_wait_in_the_delayed_wgrad_queue(hybrid, qat, input_grad):
    """Delayed wgrad (the overlap schedule's): backward leaves the expert adapters' weight gradients in
    the queue (the frozen base queues none); running it gives what plain autograd gives at once. The same
    GEMMs on the same operands, only later: equal bit for bit. Also when the experts' input needs no
    gradient (expert-only targets on a frozen base before them; QAT's low-rank path reads a detached
    input): the queued layers must still be reached by backward."""
    model = _adapted(hybrid)
    model.set_gemms(grouped=qat_gemms(qat))
    experts = next(m.mlp.experts for m in model.decoder.layers if hasattr(getattr(m, "mlp", None), "experts"))
    e = experts.linear_fc1.weight.shape[0]
    tokens_per_expert = torch.tensor([3, 0, 5, 2][:e] + [1] * max(0, e - 4))
    x = torch.randn(int(tokens_per_expert.sum()), experts.linear_fc1.weight.shape[2],
                    generator=torch.Generator().manual_seed(4))
    dy = torch.randn(x.shape[0], experts.linear_fc2.weight.shape[1], generator=torch.Generator().manual_seed(6))
    factors = {f"{fc}.{part}": getattr(getattr(experts, fc).adapter, part).weight
               for fc in ("linear_fc1", "linear_fc2") for part in ("linear_in", "linear_out")}

    def grads(queue):
        for p in factors.values():
            p.grad = None
        xi = x.clone().requires_grad_(input_grad)
        experts(xi, tokens_per_expert, wgrad_queue=queue).backward(dy)
        if queue is not None:
            assert all(p.grad is None for p in factors.values())  # nothing computed yet: all queued
            assert len(queue) == 4  # A and B of fc1 and fc2; the frozen base's fc1 and fc2 queue nothing
            assert queue.execute() == 4
            queue.finish_step()
        return xi.grad, {n: p.grad.clone() for n, p in factors.items()}

    dx_ref, ref = grads(None)
    dx, delayed = grads(WgradQueue())
    assert all(g.abs().sum() > 0 for g in ref.values())
    if input_grad:
        torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    for name in ref:
        torch.testing.assert_close(delayed[name], ref[name], rtol=0, atol=0, msg=name)
