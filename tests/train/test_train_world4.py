"""Clipping and gradient reduction at world 4: EP=2 x expert-DP=2 on 4 gloo processes.

At world 2 the expert-data-parallel group has one rank, so reducing expert gradients or their
norm over the expert replicas twice, or not at all, cannot show. Here every expert lives on two
ranks. The finalised main_grad of every parameter and the pre-clip norm are compared with
transformers' gradients at the same weights (a gradient defect would not show in the weights:
AdamW is scale-invariant), and every update with torch's AdamW from the same weights and
gradients, with the optimizer state sharded (one bucket per buffer; several buckets with the
reduction overlapped with backward) and replicated; then the sharded run's checkpoint is resumed at
EP=1 x expert-DP=4 with other buckets, where every shard boundary has moved, for one more step.
Method and error model: `tests/train/reference.py`. One 4-process launch serves every test here.
"""

from __future__ import annotations

import pytest

from tests.train import reference as R
from tests.train.reference import cuts, rows

LAYOUTS = ["ep2xedp2", "ep2xedp2-replicated-opt", "ep2xedp2-buckets-overlap", "ep1xedp4-resumed"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return R.load_runs(tmp_path_factory, "train_world4", LAYOUTS)


def test_world4_finalised_main_grad_after_step_0_equals_transformers(runs):
    for layout in LAYOUTS:
        s = runs[layout]["steps"][0]
        assert runs[layout]["world"] == 4 and s["margin_over_bound"] > 10, layout
        assert len(s["grad_diff"]) == 54
        for name, (diff, norm) in s["grad_diff"].items():
            assert norm > 0 and diff <= R.DELTA * norm, (layout, name, diff / norm)


def test_world4_grad_norm_counts_every_expert_once_at_every_step(runs):
    for layout in LAYOUTS:
        run = runs[layout]
        for t, (m, s, *returned) in enumerate(zip(rows(run), run["steps"], *run["norms_returned"])):
            assert s["margin_over_bound"] > 10 and s["norm_ref"] > 2 * R.CLIP, (layout, t)
            assert m["grad_norm"] == pytest.approx(s["norm_ref"], rel=R.DELTA, abs=0), (layout, t)
            assert all(n == m["grad_norm"] for n in returned), (layout, t)


def test_world4_later_steps_match_transformers_and_torch_adamw(runs):
    for layout in LAYOUTS:
        run = runs[layout]
        for t, (m, s) in enumerate(zip(rows(run), run["steps"])):
            assert m["loss"] == pytest.approx(s["loss_ref"], rel=R.DELTA, abs=0), (layout, t)
            for name, (diff, norm) in s["grad_diff"].items():
                assert diff <= R.DELTA * norm, (layout, t, name, diff / norm)
            worst = max(s["update_excess"], key=s["update_excess"].get)
            assert s["update_excess"][worst] <= 1, (layout, t, worst, s["update_excess"][worst])


def test_world4_expert_and_dense_replicas_stay_identical(runs):
    for layout in LAYOUTS:
        assert all(s["replica_spread"] == 0.0 for s in runs[layout]["steps"]), layout


def test_world4_sharded_runs_cut_parameters_and_every_element_is_stepped_once(runs):
    for layout in ("ep2xedp2", "ep2xedp2-buckets-overlap", "ep1xedp4-resumed"):
        owned = [steps[-1] for steps in runs[layout]["owned"]]
        cut = cuts(owned)
        assert cut, layout  # the premise: shards cut through parameters
        for name, ranges in cut.items():  # the parts tile the parameter
            assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (layout, name)
    replicated = [steps[0] for steps in runs["ep2xedp2-replicated-opt"]["owned"]]
    # replicated state: every rank steps whole tensors, the same ones as its expert-DP replica
    assert not cuts(replicated) and all(lo == 0 for o in replicated for lo, _ in o.values())
    assert replicated[0] == replicated[2] and replicated[1] == replicated[3] != replicated[0]


def test_world4_checkpoint_resumes_where_every_shard_boundary_moved(runs):
    """Step 4 of the resumed run (EP=1 x expert-DP=4, other buckets) starts from the state the
    EP=2 run saved after step 3: its update equals torch's AdamW continuing with the moments of
    steps 1-3 (checked with every step in test_world4_later_steps_match_transformers_and_torch_adamw),
    which a lost, misplaced or re-initialised piece of master weight or moment would break."""
    saved = runs["ep2xedp2-buckets-overlap"]
    resumed = runs["ep1xedp4-resumed"]
    assert [len(saved["steps"]), len(resumed["steps"])] == [3, 4]
    before = cuts([steps[-1] for steps in saved["owned"]])
    after = cuts([steps[-1] for steps in resumed["owned"]])
    assert before != after and set(before) != set(after)
    assert rows(resumed)[3]["step"] == 4
    # the weights loaded at EP=1 x expert-DP=4 are exactly those the EP=2 run ended with
    assert resumed["steps"][3]["carried_diff"] == 0.0
    worst = max(resumed["steps"][3]["update_excess"].values())
    assert worst <= 1, worst
