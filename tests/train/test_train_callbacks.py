"""Training callbacks live on the config the schedule reads (the built model's copy), not the provider's.

Through the real setup path (`setup_model_and_optimizer`) with a provider that deep-copies its
config into the model, on 2 gloo processes (DP=2), with three microbatches per step.
"""

from __future__ import annotations

import pytest
import torch

from tests.train.dist_helpers import once_per_session, run_distributed
from tests.train.workers import callbacks_worker


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return once_per_session(tmp_path_factory, "callbacks",
                            lambda folder: run_distributed(callbacks_worker, 2, folder, 3))


@pytest.fixture
def dp2_step(runs):
    """Per rank: one training step (3 microbatches) and one forward-only pass, callbacks installed by setup."""
    return [r["ok"] for r in runs]


def test_callbacks_are_installed_on_the_models_copied_config(dp2_step):
    for r in dp2_step:
        assert r["config_is_model_config"]
        assert not r["provider_finalizer"]


def test_finalizer_runs_once_per_step_with_the_model_and_groups(dp2_step):
    for r in dp2_step:
        assert r["train_calls"] == 1
        (call,) = r["calls"]
        assert call["models"] == [r["model_id"]]
        assert call["num_tokens"] == 3.0  # this rank's 3 microbatches; the finaliser sums over DP
        assert call["dp_group_size"] == 2 and call["expert_dp_group_size"] == 2


def test_finalizer_never_runs_in_forward_only_evaluation(dp2_step):
    assert all(r["calls_after_eval"] == 1 for r in dp2_step)


def test_distributed_adamw_applies_the_combined_gradient_on_every_shard(dp2_step):
    # Local contributions +1 (rank 0) and -3 (rank 1): the combined gradient is negative, so every
    # one of the 512 zero-initialised parameters increases, on both ranks, whichever rank owns it.
    # Each rank steps its own contiguous shard of the bucket; together they cover every element once.
    owned = [r["owned"] for r in dp2_step]
    assert owned[0] and owned[1]
    for name in set(owned[0]) | set(owned[1]):
        ranges = sorted(o[name] for o in owned if name in o)
        assert ranges[0][0] == 0 and ranges[-1][1] == 64 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for r in dp2_step:
        assert r["params"].numel() == 512
        assert bool((r["params"] > 0).all())
    torch.testing.assert_close(dp2_step[0]["params"], dp2_step[1]["params"], rtol=0, atol=0)


def test_callbacks_installed_on_the_provider_config_are_refused(runs):
    # The binding bug of docs/upstream-failures.md: the schedule must refuse, not silently skip the reduction.
    for r in (run["on_provider"] for run in runs):
        assert "no finalize_model_grads_func" in r["error"]
