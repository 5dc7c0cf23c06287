"""Context parallelism: CP=2 on 2 gloo processes computes what one process computes on full rows.

The loss (at the initial weights and at trained-like ones, where every head and sink matters), the
token count and every finalised gradient (the sinks' included) at CP=2 equal those of CP=1 from the
same weights and tokens, with the sliding window crossing the slice boundary, with
packed documents crossing it, and with EP=2 over the same two ranks; and on 4 processes, DP=2 x CP=2
with EP=2 inside each CP group or EP=4 over all; and with core-attention recompute (backward re-runs
the all-to-alls). Only the order of sums differs (tests/tolerances.py).
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


def _against_cp1(folder, world, layouts, **kwargs):
    """(CP=1 reference in this process for rows and packed rows, each rank's results of `layouts`)."""
    reference = {packed: cp_step(ParallelState(), packed) for packed in (False, True)}
    return reference, run_distributed(cp_worker, world, folder, layouts, **kwargs)


def assert_loss_and_tokens_equal(ref, ranks, layout):
    want = ref[layout[2]]
    tokens = sum(r[layout]["tokens"] for r in ranks)
    assert tokens == want["tokens"]
    loss = sum(r[layout]["loss_sum"] for r in ranks) / tokens
    assert loss == pytest.approx(want["loss_sum"] / want["tokens"], rel=LOSS_REL)
    # at trained-like weights every head and sink moves the loss (at initialisation a rank attending
    # with another rank's sinks changes it by less than rounding; only the gradients would show it)
    loss = sum(r[layout]["trained_loss_sum"] for r in ranks) / tokens
    assert loss == pytest.approx(want["trained_loss_sum"] / want["tokens"], rel=LOSS_REL)


def assert_every_gradient_equal(ref, ranks, layout):
    """Every rank's finalised gradients (experts: those it holds) equal CP=1's; every expert held."""
    want = ref[layout[2]]["grads"]
    for rank, r in enumerate(ranks):
        got = r[layout]["grads"]
        assert layout[1] > 1 or len(got) == len(want)
        assert_tensors_close(got, {n: want[n] for n in got}, GRAD_REL, context=f"rank {rank} {layout}")
    assert set().union(*(r[layout]["grads"] for r in ranks)) == set(want)


def layout_id(layout) -> str:
    return f"cp{layout[0]}-ep{layout[1]}-{'packed' if layout[2] else 'rows'}" + "".join(f"-{x}" for x in layout[3:])


@pytest.fixture(scope="module")
def cp2_vs_cp1(tmp_path_factory):
    return once_per_session(tmp_path_factory, "cp2_vs_cp1", lambda f: _against_cp1(f, 2, LAYOUTS, timeout=300))


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_cp2_loss_and_tokens_equal_cp1(cp2_vs_cp1, layout):
    assert_loss_and_tokens_equal(*cp2_vs_cp1, layout)


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_cp2_every_gradient_equals_cp1_on_every_rank(cp2_vs_cp1, layout):
    ref, ranks = cp2_vs_cp1
    sinks = [n for n in ref[layout[2]]["grads"] if n.endswith("softmax_offset")]
    assert len(sinks) == TINY.num_hidden_layers and all(ref[layout[2]]["grads"][n].abs().min() > 0 for n in sinks)
    assert_every_gradient_equal(ref, ranks, layout)


# World 4 = DP 2 x CP 2: two CP groups (ranks 0-1, 2-3) read different halves of the global batch;
# EP=2 spans each CP group, EP=4 all four ranks. Gradients reduce over DP x CP.
LAYOUTS_W4 = ((2, 2, True), (2, 4, False))


@pytest.fixture(scope="module")
def dp2_cp2_vs_cp1(tmp_path_factory):
    return once_per_session(tmp_path_factory, "dp2_cp2_vs_cp1", lambda f: _against_cp1(
        f, 4, LAYOUTS_W4, timeout=400, preload=("tests.train.cp_workers", "gptoss_cli.train.loop")))


@pytest.mark.parametrize("layout", LAYOUTS_W4, ids=lambda l: "dp2-" + layout_id(l))
def test_dp2_x_cp2_loss_and_every_gradient_equal_cp1(dp2_cp2_vs_cp1, layout):
    assert_loss_and_tokens_equal(*dp2_cp2_vs_cp1, layout)
    assert_every_gradient_equal(*dp2_cp2_vs_cp1, layout)
