"""`gptoss train` at context parallel 2 (alone and with EP=2 over the same two ranks) agrees step by
step with transformers' GptOssForCausalLM + torch's clip_grad_norm_ and AdamW on full rows.

The method and fixture are tests/train/reference.py's (the one of test_train_reference.py): the real
loop (`run_worker`) with parallelism.context_parallel_size=2 on 2 gloo processes, every step judged
from gptoss's own weights: loss, pre-clip grad norm and every finalised gradient (sinks included)
against transformers at those weights (DELTA), and the update against torch's AdamW (a few ulp).
"""

from __future__ import annotations

import pytest

from tests.train import reference as R
from tests.train.reference import rows

LAYOUTS = ["cp2", "cp2xep2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return R.load_runs(tmp_path_factory, "train_reference_cp", LAYOUTS)


def test_fixture_premises_hold_under_cp(runs):
    for layout in LAYOUTS:
        for t, s in enumerate(runs[layout]["steps"]):
            assert s["margin_over_bound"] > 10 and s["router_diff_over_bound"] <= 1, (layout, t)
        assert runs[layout]["steps"][0]["initial_diff"] == 0.0, layout  # starts from the HF checkpoint


def test_cp_loss_and_grad_norm_equal_transformers_at_every_step(runs):
    for layout in LAYOUTS:
        run = runs[layout]
        assert len(rows(run)) == R.STEPS
        for t, (m, s) in enumerate(zip(rows(run), run["steps"])):
            assert m["loss"] == pytest.approx(s["loss_ref"], rel=R.DELTA, abs=0), (layout, t)
            assert m["grad_norm"] == pytest.approx(s["norm_ref"], rel=R.DELTA, abs=0), (layout, t)


def test_cp_rank_tokens_are_half_of_every_row(runs):
    """Each CP rank counts the tokens of its half of every row of the whole global batch."""
    for layout in LAYOUTS:
        for m in runs[layout]["metrics"]:
            assert m["rank_tokens"] == R.GLOBAL_BATCH * R.SEQ // 2, (layout, m)


def test_cp_finalised_gradients_equal_transformers_at_every_step(runs):
    for layout in LAYOUTS:
        for t, s in enumerate(runs[layout]["steps"]):
            assert len(s["grad_diff"]) == 54  # every HF tensor of the tiny model, the sinks among them
            for name, (diff, norm) in s["grad_diff"].items():
                assert norm > 0 and diff <= R.DELTA * norm, (layout, t, name, diff / norm)


def test_cp_update_equals_torch_adamw_and_replicas_agree(runs):
    for layout in LAYOUTS:
        for t, s in enumerate(runs[layout]["steps"]):
            worst = max(s["update_excess"], key=s["update_excess"].get)
            assert s["update_excess"][worst] <= 1, (layout, t, worst)
            assert s["replica_spread"] == 0.0, (layout, t)
