"""The reference policy's per-token log-probabilities on a step's microbatches (`Microbatch.extras["ref_logp"]`).

dpo.reference=model scores each step's microbatches with a frozen reference, forward-only, before the step:
- under LoRA the reference is the frozen base itself, the adapters taken out for the pass (as GRPO's KL
  reference, rl/reference.py): it costs no memory, and it runs through the run's own schedule (pipeline
  stages included);
- otherwise a second, frozen model from the run's provider (the initial policy: the same seed or
  pretrained weights, the same expert-parallel slice), which the memory estimate counts
  (recipe/memory_dpo.py); it is called directly, so a pipeline-parallel run needs LoRA or precomputed
  (rule dpo.reference).
dpo.reference=precomputed reads them from the scores stored next to the token files (preference/scores.py),
so no reference model is in memory. Every source gives the log-probabilities `token_log_probs` computes
(train/objective.py), fp32, 0 where the label is not trained.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from gptoss_cli.preference.objective import REF_LOGP
from gptoss_cli.rl.reference import adapters_off, frozen_copy
from gptoss_cli.train.data import Microbatch
from gptoss_cli.train.objective import StepContext, token_log_probs


def _score_step(data_iterator: Iterator[Microbatch], model: torch.nn.Module, return_schedule_plan: bool = False):
    mb = next(data_iterator)
    zero = torch.zeros((), device=mb.tokens.device)
    return model(mb.tokens, **mb.model_inputs()), lambda out: (
        zero, zero, {"logp": token_log_probs(out, mb.labels).detach()})


class AdaptersOffReference:
    """The policy's own frozen base (LoRA), scored through the run's schedule with the adapters out."""

    def attach(self, microbatches: list[Microbatch], context: StepContext) -> None:
        if not microbatches:
            return
        with adapters_off(context.model.module):
            logs = context.forward_only(_score_step, microbatches)
        for mb, log in zip(microbatches, logs):
            mb.extras[REF_LOGP] = log["logp"]


class FrozenModelReference:
    """A second, frozen model (the initial policy) beside the policy (full fine-tuning)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @classmethod
    def from_provider(cls, provider: Any, state: Any) -> "FrozenModelReference":
        """The run's initial policy once more, frozen (rl/reference.py, `frozen_copy`)."""
        return cls(frozen_copy(provider, state))

    def attach(self, microbatches: list[Microbatch], context: StepContext) -> None:
        with torch.no_grad():
            for mb in microbatches:
                out = self.model(mb.tokens, **mb.model_inputs())
                mb.extras[REF_LOGP] = token_log_probs(out, mb.labels).detach()


__all__ = ["AdaptersOffReference", "FrozenModelReference"]
