"""serve-check's comparison of one prompt and the report `gptoss serve-check` renders and writes as JSON.

Per prompt, over every scored position (the prompt and gptoss's greedy continuation):
`max_abs_logprob_diff` over the full vocabulary (or the top-k the engine returned), `mean_kl`
(KL(gptoss || engine), nats per position, summed as p * (r - 1 - log r) so that it is never negative; over
the top-k the engine returned when it is top-k),
`first_divergent_position` (the first token whose logprobs lie outside the error budget, which includes
what router near-ties may move), and the greedy comparison: how many of the engine's greedy tokens
equal gptoss's before the first difference, and whether gptoss's top two logits there lie within
their error bound of each other (a near-tie, not a failure).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from gptoss_cli.generate.engines.base import PromptScores
from gptoss_cli.parity.serve.reference import Reference

PASS, FAIL = "pass", "fail"


@dataclass
class ServeFinding:
    """A known way an engine and a checkpoint part: a name, what it means here, whether it fails the check."""

    name: str
    message: str
    failing: bool = False


@dataclass
class PromptResult:
    name: str
    tokens: int  # scored tokens: prompt + gptoss's greedy continuation
    prompt_tokens: int
    max_abs_logprob_diff: float
    budget: float  # the error budget at the worst position (budget.py)
    max_budget: float
    mean_kl: float
    first_divergent_position: int | None  # index of the first token outside its budget (not a near-tie)
    worst_position: int
    near_tie_positions: list[int]
    greedy_tokens: int
    greedy_match_tokens: int
    greedy_divergence_near_tie: bool | None  # None when all greedy tokens agree
    verdict: str
    engine_greedy: list[int] = field(default_factory=list)
    gptoss_greedy: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def _kl_terms(mine: torch.Tensor, engine: torch.Tensor) -> torch.Tensor:
    """Per entry, p * (r - 1 - log r) with p gptoss's probability and r = q / p the engine's over it: summed, KL(gptoss
    || engine) of two normalised distributions (the r - 1 terms add to 1 - 1 = 0), and every term >= 0, so rounding
    that leaves the engine's probabilities summing to 1 + 1e-9 cannot make the sum negative as p * log(p / q) can."""
    d = torch.nan_to_num(engine - mine, nan=math.inf, neginf=-math.inf)
    return torch.where(mine > -math.inf, mine.exp() * (torch.expm1(d) - d), torch.zeros_like(mine))


def _engine_rows(scores: PromptScores, ref: Reference) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(|engine - gptoss| per position's max, KL per position, gptoss's logprobs of the compared entries)."""
    lp = torch.from_numpy(np.asarray(scores.logprobs, dtype=np.float64))
    want = ref.logprobs
    if lp.shape[0] != want.shape[0]:
        raise ValueError(f"the engine scored {lp.shape[0]} positions, gptoss {want.shape[0]}")
    if scores.ids is None:
        diff = (lp - want).abs()
        kl = _kl_terms(want, lp).sum(-1)
    else:
        ids = torch.from_numpy(np.asarray(scores.ids, dtype=np.int64))
        valid = ids >= 0
        mine = want.gather(1, ids.clamp(min=0))
        diff = torch.where(valid, (lp - mine).abs(), torch.zeros_like(lp))
        kl = torch.where(valid, _kl_terms(mine, torch.where(valid, lp, mine)), torch.zeros_like(lp)).sum(-1)
    diff = torch.nan_to_num(diff, nan=math.inf)
    return diff.max(dim=-1).values, kl


def compare_prompt(ref: Reference, scores: PromptScores, engine_greedy: list[int]) -> PromptResult:
    worst_per_pos, kl = _engine_rows(scores, ref)
    budget = ref.budget + (ref.flip_spread if ref.flip_spread is not None else 0.0)
    failing = worst_per_pos > budget
    first = int(failing.nonzero()[0, 0]) + 1 if failing.any() else None
    worst = int(worst_per_pos.argmax()) if worst_per_pos.numel() else 0
    # greedy: the engine's continuation of the prompt against gptoss's
    ours = ref.greedy
    match = 0
    for a, b in zip(engine_greedy, ours):
        if a != b:
            break
        match += 1
    near_tie = None
    if match < min(len(engine_greedy), len(ours)):
        row = ref.prompt_len - 1 + match  # gptoss's distribution of that token
        top2 = ref.logprobs[row].topk(2).values
        near_tie = bool(top2[0] - top2[1] <= 2 * float(ref.logit_bound[row]))
    greedy_ok = near_tie is None or near_tie
    ties = sorted(int(p) for p in ref.near_tie.nonzero().flatten().tolist())
    return PromptResult(
        name=ref.name, tokens=len(ref.ids), prompt_tokens=ref.prompt_len,
        max_abs_logprob_diff=float(worst_per_pos.max()) if worst_per_pos.numel() else 0.0,
        budget=float(budget[worst]) if budget.numel() else 0.0,
        max_budget=float(budget.max()) if budget.numel() else 0.0,
        mean_kl=float(kl.mean()) if kl.numel() else 0.0, first_divergent_position=first, worst_position=worst + 1,
        near_tie_positions=ties, greedy_tokens=len(ours), greedy_match_tokens=match,
        greedy_divergence_near_tie=near_tie, verdict=PASS if first is None and greedy_ok else FAIL,
        engine_greedy=list(engine_greedy), gptoss_greedy=list(ours),
    )


@dataclass
class ServeReport:
    """The whole check: what was served, by which engine, each prompt's figures, findings, the verdict."""

    checkpoint: str
    kind: str
    dtype: str
    served: dict[str, Any]
    engine: dict[str, Any]
    error_model: str
    prompts: list[PromptResult]
    findings: list[ServeFinding]
    seconds: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        ok = all(p.verdict == PASS for p in self.prompts) and not any(f.failing for f in self.findings)
        return PASS if ok else FAIL

    def overall(self) -> dict[str, Any]:
        ps = self.prompts
        return {
            "max_abs_logprob_diff": max((p.max_abs_logprob_diff for p in ps), default=0.0),
            "mean_kl": sum(p.mean_kl * (p.tokens - 1) for p in ps) / max(1, sum(p.tokens - 1 for p in ps)),
            "greedy_match_tokens": sum(p.greedy_match_tokens for p in ps),
            "greedy_tokens": sum(p.greedy_tokens for p in ps),
            "first_divergent_position": next(({"prompt": p.name, "position": p.first_divergent_position}
                                              for p in ps if p.first_divergent_position is not None), None),
        }

    def failure_line(self) -> str | None:
        """One line naming the first failing prompt and position, or None when the check passed."""
        for p in self.prompts:
            if p.first_divergent_position is not None:
                return (f"{p.name}: the engine's logprobs leave the {self.dtype} budget at token "
                        f"{p.first_divergent_position} of {p.tokens} (max |diff| {p.max_abs_logprob_diff:.3g} at "
                        f"token {p.worst_position}, budget there {p.budget:.3g})")
            if p.verdict == FAIL:
                return (f"{p.name}: greedy tokens part at new token {p.greedy_match_tokens} "
                        f"(engine {p.engine_greedy[p.greedy_match_tokens]}, gptoss {p.gptoss_greedy[p.greedy_match_tokens]}), "
                        "not a near-tie")
        failing = [f for f in self.findings if f.failing]
        if failing:
            return f"{failing[0].name}: {failing[0].message}"
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint, "kind": self.kind, "dtype": self.dtype, "served": self.served,
            "engine": self.engine, "error_model": self.error_model, "verdict": self.verdict, **self.overall(),
            "prompts": [p.to_json() for p in self.prompts], "findings": [asdict(f) for f in self.findings],
            "seconds": self.seconds, "notes": self.notes,
        }


__all__ = ["ServeFinding", "PromptResult", "ServeReport", "compare_prompt", "PASS", "FAIL"]
