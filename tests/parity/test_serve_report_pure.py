"""serve-check's verdict as pure functions, without an engine: which row the greedy near-tie rule reads, its
factor 2, the budget with the router flip spread, the direction of `mean_kl`, and the layer_types finding.

Definitions these tests hold the code to (docs/serve-check.md): row p of the log-probabilities is the
distribution of token p + 1; the greedy continuation starts at token `prompt_len`, so the first token the engine
and gptoss disagree on, after `match` agreeing ones, is token prompt_len + match and its distribution is row
prompt_len + match - 1. Each side's logits may be off by `logit_bound` at that row, so the two top tokens can swap
only when their gap is at most 2 x logit_bound (a near-tie, not a failure). `mean_kl` is KL(gptoss || engine),
checked against torch.nn.functional.kl_div (an independent formula: sum p (log p - log q)).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gptoss_cli.generate.engines.base import PromptScores
from gptoss_cli.model.config import preset
from gptoss_cli.parity.serve.check import known_findings
from gptoss_cli.parity.serve.reference import Reference
from gptoss_cli.parity.serve.report import FAIL, PASS, compare_prompt

PROMPT, GREEDY, V = 3, 3, 4
BOUND = 0.1


def _reference(gaps: dict[int, float], budget: float = 1e-3, flip_spread: float | None = None) -> Reference:
    """A prompt of 3 tokens and a greedy continuation [0, 0, 0]; row r's top two tokens (0 and 1) are gaps[r]
    apart in log-probability (default far apart)."""
    n = PROMPT + GREEDY
    rows = []
    for r in range(n - 1):
        logits = torch.tensor([5.0, 5.0 - gaps.get(r, 4.0), 0.0, -1.0], dtype=torch.float64)
        rows.append(torch.log_softmax(logits, -1))
    lp = torch.stack(rows)
    return Reference(name="p", prompt_len=PROMPT, ids=[7, 8, 9, 0, 0, 0], greedy=[0, 0, 0], logprobs=lp,
                     budget=torch.full((n - 1,), budget, dtype=torch.float64),
                     logit_bound=torch.full((n,), BOUND, dtype=torch.float64),
                     near_tie=torch.zeros(n, dtype=torch.bool),
                     flip_spread=None if flip_spread is None else torch.full((n - 1,), flip_spread, dtype=torch.float64))


def _same(ref: Reference, shift: float = 0.0) -> PromptScores:
    lp = ref.logprobs.clone()
    lp[:, 0] += shift
    return PromptScores(prompt_ids=ref.ids[:PROMPT], logprobs=lp.numpy())


@pytest.mark.parametrize("match", [0, 1, 2])
def test_the_near_tie_rule_reads_the_row_of_the_first_divergent_token(match):
    """The engine agrees on `match` greedy tokens, then picks token 1. Only row PROMPT + match - 1 is a near-tie:
    the verdict passes. The same tie one row earlier or later (a rule reading the wrong row) fails it."""
    divergent_row = PROMPT + match - 1
    engine = [0] * match + [1]
    for row, want in ((divergent_row, PASS), (divergent_row - 1, FAIL), (divergent_row + 1, FAIL)):
        ref = _reference({row: 0.5 * BOUND})
        result = compare_prompt(ref, _same(ref), engine)
        assert result.greedy_match_tokens == match
        assert result.verdict == want and result.greedy_divergence_near_tie is (want == PASS), (row, result)


@pytest.mark.parametrize("gap, want", [(1.5 * BOUND, PASS), (1.99 * BOUND, PASS), (2.5 * BOUND, FAIL)])
def test_two_tokens_within_twice_the_logit_bound_are_a_near_tie(gap, want):
    """Both sides' logits may be off by the bound, so a gap up to 2 x bound can swap the top two, no wider one."""
    ref = _reference({PROMPT - 1: gap})
    assert compare_prompt(ref, _same(ref), [1]).verdict == want


def test_the_budget_adds_the_router_flip_spread():
    ref = _reference({}, budget=1e-3)
    assert compare_prompt(ref, _same(ref, 5e-3), [0, 0, 0]).verdict == FAIL
    ref = _reference({}, budget=1e-3, flip_spread=1e-2)
    result = compare_prompt(ref, _same(ref, 5e-3), [0, 0, 0])
    assert result.verdict == PASS and result.max_budget == pytest.approx(1.1e-2)
    assert compare_prompt(ref, _same(ref, 2e-2), [0, 0, 0]).first_divergent_position == 1


def test_mean_kl_is_kl_of_gptoss_to_the_engine():
    """Asymmetric distributions, where KL(p || q) and KL(q || p) differ by far more than rounding."""
    ref = _reference({})
    g = torch.Generator().manual_seed(0)
    engine = torch.log_softmax(torch.randn(ref.logprobs.shape, generator=g, dtype=torch.float64) * 2, -1)
    result = compare_prompt(ref, PromptScores(prompt_ids=ref.ids[:PROMPT], logprobs=engine.numpy()), [0, 0, 0])
    forward = F.kl_div(engine, ref.logprobs, log_target=True, reduction="none").sum(-1).mean()  # sum p log(p/q)
    reverse = F.kl_div(ref.logprobs, engine, log_target=True, reduction="none").sum(-1).mean()
    assert abs(float(forward - reverse)) > 0.1
    assert result.mean_kl == pytest.approx(float(forward), rel=1e-12)


def test_mean_kl_over_the_engines_top_k_uses_gptoss_probabilities_at_those_ids():
    ref = _reference({})
    ids = np.tile(np.array([[0, 1, -1]]), (ref.logprobs.shape[0], 1))
    engine = ref.logprobs[:, :2].clone() + torch.tensor([-0.05, 0.02], dtype=torch.float64)
    lp = np.concatenate([engine.numpy(), np.full((engine.shape[0], 1), -np.inf)], 1)
    result = compare_prompt(ref, PromptScores(prompt_ids=ref.ids[:PROMPT], logprobs=lp, ids=ids), [0, 0, 0])
    p, q = ref.logprobs[:, :2].exp(), engine.exp()
    want = (p * ((q / p) - 1 - torch.log(q / p))).sum(-1).mean()  # the partial sum over the compared ids
    assert result.mean_kl == pytest.approx(float(want), rel=1e-9) and result.mean_kl > 0


def test_layer_types_other_than_alternating_are_a_vllm_finding_only():
    tiny = preset("tiny")
    assert not [f for f in known_findings(tiny, {}, "vllm", "cpu") if f.name == "layer_types"]
    odd = dataclasses.replace(tiny, layer_types=("full_attention",) * tiny.num_hidden_layers)
    found = [f for f in known_findings(odd, {}, "vllm", "cpu") if f.name == "layer_types"]
    assert len(found) == 1 and "full_attention" in found[0].message
    assert not [f for f in known_findings(odd, {}, "llama.cpp", "cpu") if f.name == "layer_types"]
