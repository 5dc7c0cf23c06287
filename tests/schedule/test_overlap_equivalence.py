"""Combined 1F1B with overlap + delayed wgrad equals the plain schedule (gloo, 2 processes, fp32).

Both schedules run side by side in the same processes from the same seeded weights on the same
data; per step and per rank the microbatch losses and every parameter's finalised gradient must
agree, and both take the same optimizer steps so later steps compare from the same weights.
"""

from __future__ import annotations

import pytest

from tests.schedule.workers import assert_grads_close, equivalence_worker
from tests.train.dist_helpers import run_distributed

STEPS, GLOBAL_BATCH, MBS = 3, 12, 2  # 3 microbatches per rank and step


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
        assert {s["schedule"] for s in plain} == {"forward_backward_no_pipelining"}
        assert {s["schedule"] for s in overlap} == {"forward_backward_combined_1f1b"}
        for step, (a, b) in enumerate(zip(plain, overlap)):
            assert len(a["loss_sums"]) == 3
            assert b["loss_sums"] == pytest.approx(a["loss_sums"], rel=1e-5), (rank, step)
            # After the first step Adam's normalisation magnifies rounding differences a little.
            assert_grads_close(b["grads"], a["grads"], rel=1e-5 if step == 0 else 1e-4)
