"""Expert parallelism: EP=2 on 2 gloo processes computes what EP=1 computes on the same global batch."""

from __future__ import annotations

import math

import pytest
import torch

from gptoss_cli.parallel.state import ParallelState
from tests.tolerances import assert_tensors_close, reassociation_rel
from tests.train.dist_helpers import once_per_session, run_distributed
from tests.train.workers import SEQ, TINY, ep_grads_worker, one_step_grads

# Same weights and tokens at EP=1 and EP=2: only the order of sums differs (tests/tolerances.py).
# A gradient element sums over the global batch's tokens (4 x 16); a logit over the hidden size.
DEPTH = 2 * TINY.num_hidden_layers + 1
GRAD_REL = reassociation_rel(4 * SEQ, DEPTH)
LOSS_REL = reassociation_rel(TINY.hidden_size, DEPTH)


def _ep2_vs_ep1(folder):
    # EP=1 reference: one process, the global batch of 4 as 2 microbatches (rank r's half = microbatch r).
    reference = one_step_grads(ParallelState())
    ranks = run_distributed(ep_grads_worker, 2, folder, 2)
    return reference, ranks


@pytest.fixture(scope="module")
def ep2_vs_ep1(tmp_path_factory):
    return once_per_session(tmp_path_factory, "ep2_vs_ep1", _ep2_vs_ep1)


def test_ep2_loss_equals_ep1_on_the_same_global_batch(ep2_vs_ep1):
    ref, ranks = ep2_vs_ep1
    loss_ep2 = sum(r["loss_sum"] for r in ranks) / sum(r["tokens"] for r in ranks)
    assert ref["tokens"] == sum(r["tokens"] for r in ranks) == 4 * 16
    assert loss_ep2 == pytest.approx(ref["loss_sum"] / ref["tokens"], rel=LOSS_REL)


def test_ep2_dense_and_router_grads_equal_ep1_on_every_rank(ep2_vs_ep1):
    ref, ranks = ep2_vs_ep1
    dense = [n for n in ref["grads"] if ".mlp.experts." not in n]
    assert any(".mlp.router." in n for n in dense)
    for rank, r in enumerate(ranks):
        assert_tensors_close({n: r["grads"][n] for n in dense}, {n: ref["grads"][n] for n in dense}, GRAD_REL, rank)


def test_ep2_expert_grads_equal_ep1_each_expert_held_once(ep2_vs_ep1):
    ref, ranks = ep2_vs_ep1
    experts = {n for n in ref["grads"] if ".mlp.experts." in n}
    held = [{n for n in r["grads"] if ".mlp.experts." in n} for r in ranks]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == experts
    assert any(n.endswith("weight0") for n in held[0]) and any(n.endswith("weight3") for n in held[1])
    for rank, (r, names) in enumerate(zip(ranks, held)):
        assert_tensors_close({n: r["grads"][n] for n in names}, {n: ref["grads"][n] for n in names}, GRAD_REL, rank)
    assert all(ref["grads"][n].abs().sum() > 0 for n in experts if "weight" in n)


def test_ep2_clipping_norm_counts_every_expert_once(ep2_vs_ep1):
    ref, ranks = ep2_vs_ep1
    true_norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in ref["grads"].values())))
    # The norm sums positive squares (no cancellation): torch's cascade sum per tensor errs by about
    # log2(n) * u, then one fp32 addition per tensor; x4 safety as in tests/tolerances.py.
    n = max(g.numel() for g in ref["grads"].values())
    norm_rel = 4 * (math.log2(n) + len(ref["grads"])) * 2.0**-24
    assert ref["grad_norm"] == pytest.approx(true_norm, rel=norm_rel)
    for r in ranks:
        assert r["grad_norm"] == pytest.approx(true_norm, rel=norm_rel + GRAD_REL)


def test_alltoall_dispatcher_round_trip_forward_and_backward(ep2_vs_ep1):
    _, ranks = ep2_vs_ep1
    for r in ranks:
        assert r["dispatch_all"]["out_ok"] and r["dispatch_all"]["grad_ok"]
    assert sum(r["dispatch_all"]["rows"] for r in ranks) == 2 * (5 + 6)  # dropless: every (token, choice)


def test_alltoall_dispatcher_handles_a_rank_that_receives_no_tokens(ep2_vs_ep1):
    _, ranks = ep2_vs_ep1
    assert ranks[1]["dispatch_rank0_only"]["rows"] == 0
    for r in ranks:
        assert r["dispatch_rank0_only"]["out_ok"] and r["dispatch_rank0_only"]["grad_ok"]
