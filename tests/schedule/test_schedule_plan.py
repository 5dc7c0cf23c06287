"""HybridModel.build_schedule_plan: node structure, detach boundaries, and the same math as forward."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.config import preset
from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.pattern import parse_pattern, schedule_plan_support
from gptoss_cli.model.schedule_plan import COMM, COMPUTE, CommNode, Ref
from gptoss_cli.model.gemm.grouped import WgradQueue
from tests.model.hybrid_helpers import tiny_batch as _batch, tiny_model as _model

TINY = preset("tiny")
E_NODES = ["pre_dispatch", "dispatch", "experts", "combine"]


def _short(node) -> str:
    return node.name.rsplit(".", 1)[-1]


def test_ungrouped_pattern_gives_one_unit_per_layer_in_order():
    ids, labels = _batch()
    plan = _model("*E*E*E").build_schedule_plan(ids, labels=labels)
    assert [[_short(n) for n in unit] for unit in plan.units] == [["attention"], E_NODES] * 3
    assert [n.layer for unit in plan.units for n in unit] == [0, 1, 1, 1, 1, 2, 3, 3, 3, 3, 4, 5, 5, 5, 5]
    nodes = plan.nodes()
    assert (nodes[0].name, nodes[-1].name) == ("embedding", "post")
    assert [n.kind for n in plan.units[1]] == [COMPUTE, COMM, COMPUTE, COMM]


def test_grouped_pattern_gives_one_unit_per_group():
    ids, labels = _batch()
    plan = _model("[*E][*E][*E]").build_schedule_plan(ids, labels=labels)
    assert [[_short(n) for n in unit] for unit in plan.units] == [["attention", *E_NODES]] * 3
    assert [n.name for n in plan.units[2]][0] == "decoder.layers.4.attention"


def test_dense_mlp_layers_get_a_compute_node():
    ids, labels = _batch()
    plan = _model("*-*E[*E]").build_schedule_plan(ids, labels=labels)
    assert [[_short(n) for n in unit] for unit in plan.units] == [
        ["attention"], ["mlp"], ["attention"], E_NODES, ["attention", *E_NODES]]


def test_every_node_input_is_a_detached_leaf():
    ids, labels = _batch()
    plan = _model("*E*E*E").build_schedule_plan(ids, labels=labels)
    plan.forward()
    checked = 0
    for node in plan.nodes():
        for key, leaf in node.leaves.items():
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                assert leaf.is_leaf and leaf.grad_fn is None, (node.name, key)
                checked += 1
        for key, src in node.inputs.items():
            leaf = node.leaves.get(key)
            if isinstance(src, Ref) and isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                # a copy, not the producer's tensor: backward stops at the node boundary
                assert node.leaves[key] is not src.node.outputs[src.key]
    assert checked > 20


def test_one_node_backward_reaches_only_its_own_parameters():
    ids, labels = _batch()
    model = _model("*E*E*E")
    plan = model.build_schedule_plan(ids, labels=labels)
    plan.forward()
    plan.post.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    # post = final norm + output layer (+ aux loss: router stats are an explicit input, not a path)
    assert with_grad == {"decoder.final_norm.weight", "output_layer.weight"}


def test_skipping_values_are_explicit_inputs():
    ids, labels = _batch()
    plan = _model("*E*E*E").build_schedule_plan(ids, labels=labels)
    attn, pre, dispatch, experts, combine = plan.units[0] + plan.units[1]
    assert pre.inputs["x"] == Ref(attn, "hidden")
    assert combine.inputs["residual"] == Ref(attn, "hidden")  # the residual skips the MoE nodes
    assert combine.inputs["prob_of_row"] == Ref(pre, "prob_of_row")  # routing weights skip dispatch/experts
    assert attn.inputs["cos"] == Ref(plan.embedding, "cos")
    assert [plan.post.inputs[f"prob_sum{i}"].node.name for i in range(3)] == [
        "decoder.layers.1.pre_dispatch", "decoder.layers.3.pre_dispatch", "decoder.layers.5.pre_dispatch"]
    assert isinstance(dispatch, CommNode) and dispatch.after_backward_start is None


@pytest.mark.parametrize("pattern", ["*E*E*E", "[*E][*E][*E]"])
@pytest.mark.parametrize("delayed", [False, True], ids=["wgrad", "delayed-wgrad"])
def test_plan_forward_backward_equals_the_model(pattern, delayed):
    ids, labels = _batch()
    model = _model(pattern)
    out = model(ids, labels=labels)
    out.loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    queue = WgradQueue() if delayed else None
    plan = model.build_schedule_plan(ids, labels=labels).configure(wgrad_queue=queue)
    result = plan.forward()
    torch.testing.assert_close(result["loss"].detach(), out.loss.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(result["extra"].aux_loss.detach(), out.aux_loss.detach(), rtol=1e-6, atol=0)
    plan.backward()
    if delayed:
        assert len(queue) == 0 and queue.executed == 6  # fc1 + fc2 of 3 MoE layers, run by the dispatch nodes
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_supports_schedule_plan_names_what_it_cannot_split():
    assert schedule_plan_support(parse_pattern("*E*E")) == (True, "")
    assert schedule_plan_support(parse_pattern("[*E][*-]")) == (True, "")
    ok, reason = schedule_plan_support(parse_pattern("*E*M"))
    assert not ok and "'M' (mamba)" in reason
    ok, reason = schedule_plan_support(parse_pattern("*E|*E"))
    assert not ok and "'|'" in reason


def test_unknown_token_dispatcher_is_rejected_naming_the_layer():
    class Opaque:
        def dispatch(self, *a): ...

        def combine(self, *a): ...

    model = _model("*E*E*E")
    model.decoder.layers[3].token_dispatcher = Opaque()
    ids, labels = _batch()
    with pytest.raises(ConfigError, match=r"decoder\.layers\.3: token dispatcher Opaque"):
        model.build_schedule_plan(ids, labels=labels)
