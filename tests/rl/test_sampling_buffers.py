"""The rollout's decoding step on reused buffers (rl/sampling.py, `choose_with_log_prob`): the token generate's
`choose` draws and the log-probability `token_log_prob` gives it, bit for bit, with the buffers holding
NaN from before."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.generate.decode import Sampling, choose
from gptoss_cli.model import workspace
from gptoss_cli.rl.sampling import choose_with_log_prob, token_log_prob


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_the_buffered_step_draws_and_scores_as_choose_and_token_log_prob(temperature, top_p):
    workspace.release()
    g = torch.Generator().manual_seed(0)
    sampling = Sampling(temperature=temperature, top_p=top_p)
    for step in range(3):  # the buffers are reused from step to step
        logits = torch.randn(5, 1003, generator=g) * 3
        want = choose(logits, sampling, torch.Generator().manual_seed(step))
        want_logp = token_log_prob(logits, want, temperature, top_p)
        workspace.fill_kept(float("nan"))
        got, got_logp = choose_with_log_prob(logits, sampling, torch.Generator().manual_seed(step))
        assert torch.equal(got, want)
        torch.testing.assert_close(got_logp, want_logp, rtol=0, atol=0, equal_nan=True)  # greedy: NaN on both sides
    assert (workspace.kept_bytes() > 0) == (temperature > 0.0)
    workspace.release()
