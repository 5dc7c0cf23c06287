"""Clipping and gradient reduction at world 4: EP=2 x expert-DP=2 on 4 gloo processes.

At world 2 the expert-data-parallel group has one rank, so reducing expert gradients or their
norm over the expert replicas twice, or not at all, cannot show. Here every expert lives on two
ranks. The finalised main_grad of every parameter and the pre-clip norm are compared with
transformers' gradients at the same weights (a gradient defect would not show in the weights:
AdamW is scale-invariant), with the optimizer state sharded over DP (the default) and replicated.
Method and error model: `tests/train/reference.py`. One 4-process launch serves every test here.
"""

from __future__ import annotations

import pytest

from tests.train import reference as R
from tests.train.dist_helpers import once_per_session

LAYOUTS = ["ep2xedp2", "ep2xedp2-replicated-opt"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    return once_per_session(tmp_path_factory, "train_world4", lambda folder: R.compute_all(folder, LAYOUTS))


def rows(run) -> list[dict]:
    return [m for m in run["metrics"] if m["rank"] == 0]


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
