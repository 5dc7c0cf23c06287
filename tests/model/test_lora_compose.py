"""LoRA composes with what the base model gained beside it: packed documents (cu_seqlens), activation
recompute (selective and full), router telemetry and the aux loss, and MXFP4 QAT's gemm wrapper."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.model.grouped_gemm import WgradQueue
from gptoss_cli.model.lora import is_adapter_name
from gptoss_cli.model.moe import ExpertLinear
from gptoss_cli.model.mxfp4 import round_to_mxfp4
from gptoss_cli.model.qat import qat_gemms
from gptoss_cli.model.recompute_plan import SELECTIVE_MODULES, RecomputePlan
from tests.model.hybrid_helpers import adapted_from
from tests.model.tiny_checkpoints import write_converted_pair

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


def test_lora_with_packed_documents_and_recompute_equals_without_recompute(hybrid):
    model = _adapted(hybrid)
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


def test_lora_under_mxfp4_qat_equals_lora_on_the_rounded_base(hybrid):
    qat = _adapted(hybrid)
    qat.set_gemms(grouped=qat_gemms("mxfp4"))
    rounded = _adapted(hybrid)
    with torch.no_grad():
        for m in rounded.modules():
            if isinstance(m, ExpertLinear):
                m.weight.copy_(round_to_mxfp4(m.weight))
    loss_q, _, grads_q = _step(qat)
    loss_r, _, grads_r = _step(rounded)
    torch.testing.assert_close(loss_q, loss_r, rtol=1e-6, atol=1e-6)
    for name in grads_r:
        torch.testing.assert_close(grads_q[name], grads_r[name], rtol=1e-5, atol=1e-6, msg=name)


def test_expert_adapters_weight_gradients_wait_in_the_delayed_wgrad_queue(hybrid):
    """Delayed wgrad (the overlap schedule's): backward leaves the expert adapters' weight gradients in
    the queue (the frozen base queues none); running it gives what plain autograd gives at once. The same
    GEMMs on the same operands, only later: equal bit for bit."""
    model = _adapted(hybrid)
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
        xi = x.clone().requires_grad_(True)
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
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    for name in ref:
        torch.testing.assert_close(delayed[name], ref[name], rtol=0, atol=0, msg=name)
