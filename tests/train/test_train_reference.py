"""`gptoss train` agrees step by step with an independent trainer (transformers' GptOssForCausalLM,
torch's clip_grad_norm_ and AdamW) at EP=1, EP=2 and DP=2 x EP=1.

The real loop (`run_worker`) trains from a transformers-made HF checkpoint on a token file holding
one global batch (fp32, constant lr, weight decay 1.0, clip 1.1, aux loss 0). The reference restarts
from gptoss's weights at every step, so AdamW cannot amplify rounding from one step into the next;
each step is judged twice: (a) loss, grad norm and finalised gradients against transformers at the
same weights (fp32 reordering: DELTA), (b) the update against torch's AdamW given the same weights
and gradients (a few ulp). The error model and the method are in `tests/train/reference.py`.

One in-process run (EP=1) and one 2-process launch (EP=2, then DP=2) serve every test here.
"""

from __future__ import annotations

import pytest

from tests.train import reference as R
from tests.train.reference import rows

LAYOUTS = ["ep1", "ep2", "dp2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return R.load_runs(tmp_path_factory, "train_reference", LAYOUTS)


def test_fixture_routes_far_from_ties_and_clips_every_step(runs):
    """The test's premises: no routing decision can flip between the two implementations (every
    top-k gap exceeds the logits' fp32 error bound by 10x, and the measured difference is within
    the bound), and the gradient norm exceeds the clip, so clipping engages at every step."""
    for layout in LAYOUTS:
        for t, s in enumerate(runs[layout]["steps"]):
            assert s["margin_over_bound"] > 10, (layout, t, s["routing_margin"])
            assert s["router_diff_over_bound"] <= 1, (layout, t)
            assert s["norm_ref"] > 2 * R.CLIP, (layout, t)


def test_training_starts_from_the_transformers_checkpoint(runs):
    for layout in LAYOUTS:
        assert runs[layout]["steps"][0]["initial_diff"] == 0.0, layout


def test_loss_equals_transformers_at_every_step(runs):
    for layout in LAYOUTS:
        run = runs[layout]
        assert len(rows(run)) == R.STEPS
        for t, (m, s) in enumerate(zip(rows(run), run["steps"])):
            assert m["loss"] == pytest.approx(s["loss_ref"], rel=R.DELTA, abs=0), (layout, t)


def test_pre_clip_grad_norm_equals_transformers_at_every_step(runs):
    for layout in LAYOUTS:
        run = runs[layout]
        for t, (m, s, *returned) in enumerate(zip(rows(run), run["steps"], *run["norms_returned"])):
            assert m["grad_norm"] == pytest.approx(s["norm_ref"], rel=R.DELTA, abs=0), (layout, t)
            assert all(n == m["grad_norm"] for n in returned), (layout, t)  # every rank clips alike


def test_finalised_gradients_equal_transformers_at_every_step(runs):
    """Every parameter's main_grad after finalisation (all ranks together) against transformers'
    gradient of the mean token loss over the global batch, tensor by tensor."""
    for layout in LAYOUTS:
        for t, s in enumerate(runs[layout]["steps"]):
            assert len(s["grad_diff"]) == 54  # every HF tensor of the tiny model
            for name, (diff, norm) in s["grad_diff"].items():
                assert norm > 0 and diff <= R.DELTA * norm, (layout, t, name, diff / norm)


def test_update_equals_torch_clip_and_adamw_from_the_same_weights(runs):
    """W_{t+1} of gptoss against torch's clip_grad_norm_(1.1) + AdamW(lr, weight decay 1.0 except
    biases, norms and sinks) applied to gptoss's W_t and gradients: within a few ulp (error model)."""
    for layout in LAYOUTS:
        for t, s in enumerate(runs[layout]["steps"]):
            worst = max(s["update_excess"], key=s["update_excess"].get)
            assert s["update_excess"][worst] <= 1, (layout, t, worst, s["update_excess"][worst])


def test_metrics_lr_column_is_the_lr_of_each_update(runs):
    for layout in LAYOUTS:
        run = runs[layout]
        assert [m["lr"] for m in rows(run)] == [R.LR] * R.STEPS == run["lr_args"], layout


def test_replicas_hold_identical_weights_after_every_step(runs):
    for layout in ("ep2", "dp2"):
        assert all(s["replica_spread"] == 0.0 for s in runs[layout]["steps"]), layout
