"""The distributed optimizer at world 8 (EP=4 x expert-DP=2) against transformers and torch's AdamW.

One training step through `gptoss train`'s loop on 8 gloo processes, gradient buckets reduce-
scattered during backward, shards cutting through parameters: the finalised gradient of every
parameter and the pre-clip norm against transformers' at the same weights, the update against
torch's clip_grad_norm_ + AdamW given the same weights and gradients (method and error model:
`tests/train/reference.py`). One 8-process launch serves every test here.
"""

from __future__ import annotations

import pytest

from tests.train import reference as R
from tests.train.reference import cuts, rows

LAYOUT = "ep4xedp2-buckets-overlap"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return R.load_runs(tmp_path_factory, "train_world8", [LAYOUT])[LAYOUT]


def test_world8_finalised_gradients_and_norm_equal_transformers(run):
    (step,) = run["steps"]
    (m,) = rows(run)
    assert run["world"] == 8 and step["margin_over_bound"] > 10 and step["norm_ref"] > 2 * R.CLIP
    assert m["loss"] == pytest.approx(step["loss_ref"], rel=R.DELTA, abs=0)
    assert m["grad_norm"] == pytest.approx(step["norm_ref"], rel=R.DELTA, abs=0)
    assert all(norms == [m["grad_norm"]] for norms in run["norms_returned"])
    assert len(step["grad_diff"]) == 54
    for name, (diff, norm) in step["grad_diff"].items():
        assert norm > 0 and diff <= R.DELTA * norm, (name, diff / norm)


def test_world8_update_equals_torch_adamw_from_the_same_weights(run):
    (step,) = run["steps"]
    worst = max(step["update_excess"], key=step["update_excess"].get)
    assert step["update_excess"][worst] <= 1, (worst, step["update_excess"][worst])
    assert step["replica_spread"] == 0.0  # every rank holds the same parameters after the all-gathers


def test_world8_shards_cut_parameters(run):
    assert cuts([steps[0] for steps in run["owned"]])
