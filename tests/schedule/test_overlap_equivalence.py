"""Combined 1F1B with overlap + delayed wgrad (and gradient buckets reduced during the last
backward, overlap_grad_reduce) equals the plain schedule (gloo, 2 processes, fp32).

Both schedules run side by side in the same processes on the same data, and at every step from the
same weights (the plain run's, copied into the overlap model after each optimizer step); per step
and per rank the microbatch losses and every parameter's finalised gradient must agree within the
reassociation bound of tests/tolerances.py.
"""

from __future__ import annotations

import pytest

from tests.schedule.workers import TINY, equivalence_worker
from tests.tolerances import assert_tensors_close, reassociation_rel
from tests.train.dist_helpers import run_distributed

STEPS, GLOBAL_BATCH, MBS = 3, 12, 2  # 3 microbatches per rank and step
SEQ = 16
# Largest sums: a gradient element adds over every token of the step (12 samples x 16 tokens) in
# either order; the loss of a token sums over the hidden size; through every layer and the head.
GRAD_REL = reassociation_rel(GLOBAL_BATCH * SEQ, depth=2 * TINY.num_hidden_layers + 1)
LOSS_REL = reassociation_rel(TINY.hidden_size, depth=2 * TINY.num_hidden_layers + 1)


@pytest.mark.parametrize(
    ("ep", "pattern"),
    # grouped EP=2 merges comm nodes of both microbatches inside one slot, the ungrouped form pairs
    # an attention slot with an MoE slot
    [(2, "*E*E*E"), (2, "[*E][*E][*E]"), (1, "[*E][*E][*E]")],
    ids=["ep2-ungrouped", "ep2-grouped", "dp2xep1-grouped"],
)
def test_overlap_schedule_matches_plain_schedule(tmp_path, ep, pattern):
    ranks = run_distributed(equivalence_worker, 2, tmp_path, ep, STEPS, GLOBAL_BATCH, MBS, pattern, timeout=240)
    for rank, runs in enumerate(ranks):
        plain, overlap = runs["plain"], runs["overlap"]
        assert len(plain) == len(overlap) == STEPS
        assert {s["schedule"] for s in plain} == {"forward_backward_no_pipelining"}
        assert {s["schedule"] for s in overlap} == {"forward_backward_combined_1f1b"}
        for step, (a, b) in enumerate(zip(plain, overlap)):
            assert len(a["loss_sums"]) == 3
            assert b["loss_sums"] == pytest.approx(a["loss_sums"], rel=LOSS_REL), (rank, step)
            assert_tensors_close(b["grads"], a["grads"], GRAD_REL, context=(rank, step))
        # the steps really trained: later steps see other weights and data, so other gradients
        name = "decoder.layers.1.mlp.router.weight"
        assert (plain[0]["grads"][name] - plain[-1]["grads"][name]).abs().max() > 1e3 * GRAD_REL * \
            plain[0]["grads"][name].abs().max()
