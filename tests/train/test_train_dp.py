"""Data parallelism: DP=2 computes the same finalised gradients as DP=1 with gradient accumulation."""

from __future__ import annotations

from gptoss_cli.parallel.state import ParallelState
from tests.tolerances import assert_tensors_close, reassociation_rel
from tests.train.dist_helpers import run_distributed
from tests.train.workers import SEQ, TINY, dp_grads_worker, grads_per_step

STEPS, GLOBAL_BATCH = 3, 4
# A gradient element sums over every token of the global batch, through every layer and the head.
REL = reassociation_rel(GLOBAL_BATCH * SEQ, depth=2 * TINY.num_hidden_layers + 1)


def test_dp2_finalised_grads_equal_dp1_with_accumulation_at_every_step(tmp_path):
    # Global batch 4: DP=1 runs 4 microbatches of 1; DP=2 runs 2 microbatches of 1 per rank. Each
    # DP=2 step starts from the weights the DP=1 reference had at that step (tests/tolerances.py).
    reference = grads_per_step(ParallelState(), GLOBAL_BATCH, 1, steps=STEPS)
    ranks = run_distributed(dp_grads_worker, 2, tmp_path, [s["weights"] for s in reference], GLOBAL_BATCH, 1)
    for rank, steps in enumerate(ranks):
        assert len(steps) == STEPS
        for step, (got, want) in enumerate(zip(steps, reference)):
            # finalised = reduced over DP and divided by the GLOBAL token count: a missing or doubled
            # reduction, or a division by the local count, is off by a factor of about 2
            assert_tensors_close(got["grads"], want["grads"], REL, context=(rank, step))
    # each rank saw half of the global batch, together all of it
    assert sum(r[0]["tokens"] for r in ranks) == reference[0]["tokens"] == GLOBAL_BATCH * SEQ
    assert abs(sum(r[0]["loss_sum"] for r in ranks) - reference[0]["loss_sum"]) <= REL * reference[0]["loss_sum"]
    # the reference really moved between steps, so every step is a different comparison
    name = "decoder.layers.1.mlp.router.weight"
    assert (reference[0]["weights"][name] != reference[-1]["weights"][name]).any()
