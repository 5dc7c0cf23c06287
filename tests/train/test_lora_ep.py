"""LoRA under expert parallelism: EP=2 on 2 gloo processes computes EP=1's adapter gradients; only the
adapters are trainable and in the gradient buffers; expert adapters live with their experts."""

from __future__ import annotations

import pytest

from gptoss_cli.parallel.state import ParallelState
from tests.tolerances import assert_tensors_close, reassociation_rel
from tests.train.dist_helpers import once_per_session, run_distributed
from tests.train.lora_workers import lora_ep_worker, lora_grads, lora_overlap_worker
from tests.train.workers import SEQ, TINY

DEPTH = 2 * TINY.num_hidden_layers + 1
GRAD_REL = reassociation_rel(4 * SEQ, DEPTH)  # as tests/train/test_parallel_ep.py: sums over the global batch


def _run(folder):
    return lora_grads(ParallelState()), run_distributed(lora_ep_worker, 2, folder, 2)


@pytest.fixture(scope="module")
def ep2_vs_ep1(tmp_path_factory):
    return once_per_session(tmp_path_factory, "lora_ep2_vs_ep1", _run)


def test_only_adapters_are_trainable_and_buffered(ep2_vs_ep1):
    ref, ranks = ep2_vs_ep1
    for r in (ref, *ranks):
        assert r["trainable"] and all(".adapter.linear_" in n for n in r["trainable"])
        assert sorted(r["buffered"]) == sorted(r["trainable"])  # no gradient buffer for the base


def test_ep2_adapter_grads_equal_ep1(ep2_vs_ep1):
    ref, ranks = ep2_vs_ep1
    dense = {n for n in ref["grads"] if ".mlp.experts." not in n}
    experts = set(ref["grads"]) - dense
    assert any(".linear_qkv.adapter." in n for n in dense) and any("linear_fc2.adapter.linear_in.weight3" in n for n in experts)
    held = [{n for n in r["grads"] if ".mlp.experts." in n} for r in ranks]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == experts  # each expert's adapters on its rank
    for rank, (r, names) in enumerate(zip(ranks, held)):
        assert_tensors_close({n: r["grads"][n] for n in dense}, {n: ref["grads"][n] for n in dense}, GRAD_REL, rank)
        assert_tensors_close({n: r["grads"][n] for n in names}, {n: ref["grads"][n] for n in names}, GRAD_REL, rank)
    assert all(ref["grads"][n].abs().sum() > 0 for n in ref["grads"])  # B random: A's gradients too


@pytest.mark.parametrize("base_experts,qat", [("bf16", "none"), ("mxfp4", "none"), ("bf16", "mxfp4"),
                                             ("mxfp4", "mxfp4")])
def test_overlap_schedule_with_delayed_wgrad_gives_the_plain_adapter_grads(base_experts, qat, tmp_path):
    """EP=2, combined 1F1B + delayed wgrad + overlap_grad_reduce against the plain schedule, same model
    and data: the frozen base (bf16, or MXFP4 blocks/scales) queues no weight gradients, the adapters'
    gradients agree (also under MXFP4 QAT, where the adapters' low-rank path reads a detached input and
    only its queued weight gradients reach them)."""
    ranks = run_distributed(lora_overlap_worker, 2, tmp_path, 2, base_experts, qat, timeout=240)
    rel = reassociation_rel(12 * SEQ, DEPTH)
    for rank, r in enumerate(ranks):
        assert r["overlap"]["schedule"] == "forward_backward_combined_1f1b"
        assert r["plain"]["schedule"] == "forward_backward_no_pipelining"
        assert r["plain"]["grads"] and set(r["plain"]["grads"]) == set(r["overlap"]["grads"])
        assert_tensors_close(r["overlap"]["grads"], r["plain"]["grads"], rel, rank)


def _run_mxfp4(folder):
    return lora_grads(ParallelState(), "mxfp4"), run_distributed(lora_ep_worker, 2, folder, 2, "mxfp4")


def test_ep2_on_an_mxfp4_base_equals_ep1_and_training_keeps_the_base_bits(tmp_path):
    """lora.base_experts=mxfp4: each EP rank holds its own experts' blocks/scales (encoded from the same
    seeded values as EP=1's), so the adapter gradients of EP=2 equal EP=1's as for a bf16 base; two
    optimizer steps move every adapter factor and leave every bit of the base (blocks, scales, frozen
    parameters) as loaded."""
    ref, ranks = _run_mxfp4(tmp_path)
    experts = {n for n in ref["grads"] if ".mlp.experts." in n}
    dense = set(ref["grads"]) - experts
    held = [{n for n in r["grads"] if ".mlp.experts." in n} for r in ranks]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == experts
    for rank, (r, names) in enumerate(zip(ranks, held)):
        assert_tensors_close({n: r["grads"][n] for n in dense}, {n: ref["grads"][n] for n in dense}, GRAD_REL, rank)
        assert_tensors_close({n: r["grads"][n] for n in names}, {n: ref["grads"][n] for n in names}, GRAD_REL, rank)
    for r in (ref, *ranks):
        assert len(r["packed"]) == 2 * 2 * 3  # blocks and scales of fc1 and fc2 in each of the 3 MoE layers
        assert r["trainable"] and all(".adapter.linear_" in n for n in r["trainable"])
        assert sorted(r["buffered"]) == sorted(r["trainable"])
        assert r["base_changed"] == [] and r["adapters_moved"]
