"""Whether a rollout engine serves the policy's weights: one probe prompt scored by both, and what a difference means.

After every push (rl/engines.py, `VllmRollout.sync`) the engine's log-probabilities of the probe over the
whole vocabulary are compared with the trainer's own forward of the weights just pushed, position by
position, within serve-check's error budget (parity/serve/budget.py), which the trainer's weights carry
through their own layers: a run whose training sharpens attention or grows the output layer gets the
budget those weights call for, not the initial model's.

Past the budget, three causes are told apart, from the trainer's log-probabilities of the previous push
kept for the purpose:
- the engine lies closer to the previous version than to this one: the push did not take (an error);
- it lies within sqrt(n) budgets of this version (n the longest dot product or sum, as in the budget):
  the engine has the weights and rounds more than the model allows, up to an engine whose every sum
  adds in the worst order (n * u instead of sqrt(n) * u). Importance sampling corrects what that does
  to the loss, so the run warns and goes on;
- farther still: the engine serves other weights than the policy's, as when a reload misses a layer
  (the experts or the sinks: docs/rl.md, "Rollout engines") (an error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

PASSED, ROUNDING, NOT_TAKEN, OTHER_WEIGHTS = "passed", "rounding", "not taken", "other weights"


@dataclass
class Fingerprint:
    """One comparison: the worst position's |difference| and budget, and what it means."""

    version: int
    max_abs_logprob_diff: float
    budget: float  # the budget at the worst position (diff / budget largest there)
    ratio: float  # the largest diff / budget over the probe's positions
    verdict: str
    first_position: int | None = None
    previous_diff: float | None = None  # max |engine - the previous version| (when judged against it)
    push_moved: float | None = None  # max |this version - the previous one| (the trainer's)
    rounding_limit: float = 0.0  # ratio up to which an excess is the engine's rounding (sqrt(n))

    def metrics(self) -> dict[str, float]:
        return {"fingerprint_logp_abs": self.max_abs_logprob_diff, "fingerprint_budget": self.budget}

    def describe(self, when: str, probe_len: int) -> str:
        where = f" (first at token {self.first_position})" if self.first_position is not None else ""
        return (f"version {self.version} ({when}): on a {probe_len}-token probe the engine's log-probabilities "
                f"differ from the trainer's by up to {self.max_abs_logprob_diff:.3g}, {self.ratio:.3g}x the "
                f"rounding budget {self.budget:.2g} of these weights{where}")


class FingerprintCheck:
    """The probe, and the trainer's log-probabilities of the last version checked (see the module docstring)."""

    def __init__(self, probe: list[int]):
        self.probe = list(probe)
        self.previous: tuple[int, torch.Tensor] | None = None  # (version, the trainer's logprobs [T - 1, V])
        self.last: Fingerprint | None = None

    def check(self, model: torch.nn.Module, score: Callable[[list[int]], Any], version: int,
              dtype: torch.dtype) -> Fingerprint:
        """Compare the engine (`score(probe)` -> PromptScores) with `model` at `version`; the Fingerprint."""
        from gptoss_cli.parity.serve.reference import reference_for
        from gptoss_cli.parity.serve.report import compare_prompt

        ref = reference_for(model, "probe", self.probe, greedy_tokens=0, dtype=dtype)
        scores = score(self.probe)
        result = compare_prompt(ref, scores, [])
        engine = torch.from_numpy(np.asarray(scores.logprobs, dtype=np.float64))
        budget = ref.budget + (ref.flip_spread if ref.flip_spread is not None else 0.0)
        per_position = torch.nan_to_num((engine - ref.logprobs).abs(), nan=math.inf).amax(dim=-1)
        ratios = per_position / budget.clamp(min=1e-300)
        worst = int(ratios.argmax()) if ratios.numel() else 0
        arch = model.arch
        n_terms = max(arch.hidden_size, arch.intermediate_size, arch.head_dim, len(self.probe))
        fp = Fingerprint(version, result.max_abs_logprob_diff, float(budget[worst]) if budget.numel() else 0.0,
                         float(ratios.max()) if ratios.numel() else 0.0, PASSED,
                         first_position=result.first_divergent_position, rounding_limit=math.sqrt(n_terms))
        if result.first_divergent_position is not None:
            fp.verdict = self._judge(fp, engine, ref.logprobs)
        if fp.verdict in (PASSED, ROUNDING):
            self.previous = (version, ref.logprobs)
        self.last = fp
        return fp

    def _judge(self, fp: Fingerprint, engine: torch.Tensor, current: torch.Tensor) -> str:
        if self.previous is not None and self.previous[0] != fp.version:
            before = self.previous[1]
            fp.previous_diff = float(torch.nan_to_num((engine - before).abs(), nan=math.inf).max())
            fp.push_moved = float((current - before).abs().max())
            if fp.previous_diff < fp.max_abs_logprob_diff:
                return NOT_TAKEN
        return ROUNDING if fp.ratio <= fp.rounding_limit else OTHER_WEIGHTS

    def cause(self, fp: Fingerprint) -> str:
        """The likely cause of a failed or warned check, in words."""
        if fp.verdict == NOT_TAKEN:
            return (f"the engine still serves version {self.previous[0]}'s weights (it is {fp.previous_diff:.3g} "
                    f"from them, {fp.max_abs_logprob_diff:.3g} from these): the push did not take")
        if fp.verdict == ROUNDING:
            return (f"the engine has these weights and rounds more than the error model allows (within "
                    f"{fp.rounding_limit:.3g}x, an engine whose sums add in the worst order): its kernels on this "
                    "machine, not a lost push; importance sampling corrects the loss for it")
        moved = f" (the push moved the probe by {fp.push_moved:.3g})" if fp.push_moved is not None else ""
        return (f"the engine serves other weights than the policy's{moved}: a layer the reload missed, or an engine "
                "that computes this model differently (`gptoss serve-check` of a checkpoint names the token)")


__all__ = ["Fingerprint", "FingerprintCheck", "PASSED", "ROUNDING", "NOT_TAKEN", "OTHER_WEIGHTS"]
