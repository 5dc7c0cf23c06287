"""The decoding loop's choices: stop tokens end a row, and temperature + top-p sampling draws from
exactly the distribution transformers' logits warpers define."""

from __future__ import annotations

import torch

from gptoss_cli.generate.decode import MAX_NEW_TOKENS, STOP_TOKEN, Sampling, choose, generate_ids, top_p_filter
from gptoss_cli.model.hybrid import HybridModel
from tests.model.conftest import TINY, tokens


def _model() -> HybridModel:
    torch.manual_seed(0)
    return HybridModel(TINY).eval()


def test_a_stop_token_ends_its_row_and_is_kept_the_others_run_on():
    model = _model()
    prompts = [tokens(1, 4, seed=1)[0].tolist(), tokens(1, 6, seed=2)[0].tolist()]
    free = generate_ids(model, prompts, max_new_tokens=10)
    assert all(g.stop_reason == MAX_NEW_TOKENS and len(g.output_ids) == 10 for g in free)
    stop = free[0].output_ids[3]
    first = free[0].output_ids.index(stop)
    got = generate_ids(model, prompts, max_new_tokens=10, stop_ids=[stop])
    assert got[0].output_ids == free[0].output_ids[:first + 1]
    assert (got[0].stop_reason, got[0].stop_token) == (STOP_TOKEN, stop)
    if stop not in free[1].output_ids:
        assert got[1].output_ids == free[1].output_ids


def test_streaming_callback_sees_every_new_token_in_order():
    model = _model()
    seen = []
    (g,) = generate_ids(model, [[1, 2, 3]], max_new_tokens=5, on_token=lambda row, t: seen.append((row, t)))
    assert seen == [(0, t) for t in g.output_ids]


def _hf_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)


def test_temperature_and_top_p_equal_transformers_warpers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 300, generator=g, dtype=torch.float64) * 3
    for temperature, top_p in [(1.0, 0.9), (0.7, 0.5), (1.3, 0.99), (2.0, 1.0)]:
        ours = top_p_filter(torch.softmax(logits / temperature, dim=-1), top_p)
        ours = ours / ours.sum(-1, keepdim=True)
        want = _hf_probs(logits, temperature, top_p)
        assert torch.equal(ours > 0, want > 0), (temperature, top_p)
        torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-15)


def test_sampling_draws_from_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -9.0]])
    s = Sampling(temperature=0.7, top_p=0.9, seed=3)
    gen = torch.Generator().manual_seed(s.seed)
    draws = torch.stack([choose(logits, s, gen) for _ in range(4000)]).flatten()
    p = _hf_probs(logits.double(), 0.7, 0.9)[0]
    freq = torch.bincount(draws, minlength=5).double() / len(draws)
    assert set(draws.tolist()) == set(torch.nonzero(p).flatten().tolist())
    # 4000 draws: a frequency is within 5 standard deviations (sqrt(p(1-p)/n) <= 0.008) of p
    assert (freq - p).abs().max() < 0.04
