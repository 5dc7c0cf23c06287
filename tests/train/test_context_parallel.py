"""Context parallelism: CP=2 on 2 gloo processes computes what one process computes on full rows.

The loss, the token count and every finalised gradient (the sinks' included) at CP=2 equal those of
CP=1 from the same weights and tokens, with the sliding window crossing the slice boundary, with
packed documents crossing it, and with EP=2 over the same two ranks; and on 4 processes, DP=2 x CP=2
with EP=2 inside each CP group or EP=4 over all. Only the order of sums differs (tests/tolerances.py).
"""

from __future__ import annotations

import pytest

from gptoss_cli.parallel.state import ParallelState
from tests.tolerances import assert_tensors_close, reassociation_rel
from tests.train.cp_workers import GLOBAL_BATCH, LAYOUTS, SEQ, TINY, cp_step, cp_worker
from tests.train.dist_helpers import once_per_session, run_distributed

DEPTH = 2 * TINY.num_hidden_layers + 1
GRAD_REL = reassociation_rel(GLOBAL_BATCH * SEQ, DEPTH)  # a weight gradient sums over the batch's tokens
LOSS_REL = reassociation_rel(max(TINY.hidden_size, GLOBAL_BATCH * SEQ), DEPTH)


def _run(folder):
    reference = {packed: cp_step(ParallelState(), packed) for packed in (False, True)}
    ranks = run_distributed(cp_worker, 2, folder, LAYOUTS, timeout=300)
    return reference, ranks


@pytest.fixture(scope="module")
def cp2_vs_cp1(tmp_path_factory):
    return once_per_session(tmp_path_factory, "cp2_vs_cp1", _run)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"cp{l[0]}-ep{l[1]}-{'packed' if l[2] else 'rows'}")
def test_cp2_loss_and_tokens_equal_cp1(cp2_vs_cp1, layout):
    ref, ranks = cp2_vs_cp1
    want = ref[layout[2]]
    tokens = sum(r[layout]["tokens"] for r in ranks)
    assert tokens == want["tokens"]
    loss = sum(r[layout]["loss_sum"] for r in ranks) / tokens
    assert loss == pytest.approx(want["loss_sum"] / want["tokens"], rel=LOSS_REL)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"cp{l[0]}-ep{l[1]}-{'packed' if l[2] else 'rows'}")
def test_cp2_every_gradient_equals_cp1_on_every_rank(cp2_vs_cp1, layout):
    ref, ranks = cp2_vs_cp1
    want = ref[layout[2]]["grads"]
    sinks = [n for n in want if n.endswith("softmax_offset")]
    assert len(sinks) == TINY.num_hidden_layers and all(want[n].abs().min() > 0 for n in sinks)
    for rank, r in enumerate(ranks):
        got = r[layout]["grads"]
        held = {n: want[n] for n in got}  # EP: a rank holds the gradients of its own experts
        assert len(got) == len(want) or layout[1] > 1
        assert_tensors_close(got, held, GRAD_REL, context=f"rank {rank} {layout}")
    if layout[1] > 1:  # every expert held by some rank
        assert set().union(*(r[layout]["grads"] for r in ranks)) == set(want)


# World 4 = DP 2 x CP 2: two CP groups (ranks 0-1, 2-3) read different halves of the global batch;
# EP=2 spans each CP group, EP=4 all four ranks. Gradients reduce over DP x CP.
LAYOUTS_W4 = ((2, 2, True), (2, 4, False))


def _run_w4(folder):
    reference = {packed: cp_step(ParallelState(), packed) for packed in (False, True)}
    ranks = run_distributed(cp_worker, 4, folder, LAYOUTS_W4, timeout=400,
                            preload=("tests.train.cp_workers", "gptoss_cli.train.loop"))
    return reference, ranks


@pytest.fixture(scope="module")
def dp2_cp2_vs_cp1(tmp_path_factory):
    return once_per_session(tmp_path_factory, "dp2_cp2_vs_cp1", _run_w4)


@pytest.mark.parametrize("layout", LAYOUTS_W4, ids=lambda l: f"dp2-cp{l[0]}-ep{l[1]}-{'packed' if l[2] else 'rows'}")
def test_dp2_x_cp2_loss_and_every_gradient_equal_cp1(dp2_cp2_vs_cp1, layout):
    ref, ranks = dp2_cp2_vs_cp1
    want = ref[layout[2]]
    tokens = sum(r[layout]["tokens"] for r in ranks)
    assert tokens == want["tokens"]
    assert sum(r[layout]["loss_sum"] for r in ranks) / tokens == pytest.approx(
        want["loss_sum"] / want["tokens"], rel=LOSS_REL)
    for rank, r in enumerate(ranks):
        got = r[layout]["grads"]
        assert_tensors_close(got, {n: want["grads"][n] for n in got}, GRAD_REL, context=f"rank {rank} {layout}")
    assert set().union(*(r[layout]["grads"] for r in ranks)) == set(want["grads"])
