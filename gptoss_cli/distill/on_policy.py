"""On-policy distillation (distill.on_policy=true): the student samples, the teacher scores what it sampled.

The rollouts are GRPO's (gptoss_cli/rl/rollouts.py: rl.prompts rendered in harmony, sampled by
rl.rollout.engine, cut into microbatches, the trainer's old and the engine's log-probabilities, the
mismatch metrics), without a reward: `TeacherRollouts` scores every sampled token with the teacher
instead (a forward of the frozen teacher, distill.teacher=model, gptoss_cli/distill/teacher.py) and
stores its log-probability at rl.temperature (`teacher_logp`) and whether the token is the teacher's
most likely one (`teacher_top1`), both computed by `gptoss score`'s function (score/compute.py) at K = 1.

The loss is GRPO's clipped surrogate (rl/objective.py) with a per-token advantage

    A_t = teacher_t - old_t        (teacher and student log-probabilities of the sampled token)

so its gradient, -A_t grad log p_t at the rollout's weights, is the policy gradient of the per-token
reverse KL, KL(student || teacher) estimated on the student's own samples (each token's own term, no
sum over the tokens after it). The importance correction (rl.is_correction, rl/importance.py), the
mismatch metrics and the clip are GRPO's own. A precomputed teacher cannot
score tokens that do not exist yet: the rules refuse it on-policy.

Metrics: `reverse_kl`, the mean of old_t - teacher_t over sampled tokens (an unbiased estimate of
KL(student || teacher) per token at the rollout's weights; the step's `loss` is the same number with
rl.loss=dapo and one step per rollout); `teacher_top1`, the share of sampled tokens that are the
teacher's most likely token.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from gptoss_cli.model.loss import IGNORE_INDEX
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.rl.objective import GRPOObjective
from gptoss_cli.rl.rollouts import RolloutData
from gptoss_cli.train.data import Microbatch
from gptoss_cli.train.objective import StepContext
from gptoss_cli.train.progress import MetricDisplay


class TeacherRollouts(RolloutData):
    """GRPO's rollouts without a reward, every sampled token scored by the teacher (module docstring)."""

    rewarded = False

    def __init__(self, *args: Any, teacher: Any, **kwargs: Any):
        self.teacher = teacher
        super().__init__(*args, **kwargs)

    def _score_policies(self, microbatches: list[Microbatch], context: StepContext) -> None:
        from gptoss_cli.score.compute import score_positions  # noqa: PLC0415

        super()._score_policies(microbatches, context)  # old_logp over several steps, ref_logp with a KL term
        for mb in microbatches:
            # the teacher routes live: the captured routes are the student's experts (rl.routing_replay)
            inputs = {k: v for k, v in mb.model_inputs().items() if k != "routes"}
            out = self.teacher.forward(mb.tokens, **inputs)
            labels = mb.labels.reshape(-1)
            at = torch.nonzero(labels != IGNORE_INDEX).flatten()
            hidden = out.hidden.reshape(-1, out.hidden.shape[-1]).index_select(0, at)
            with torch.no_grad():
                got = score_positions(hidden, out.head_weight, labels.index_select(0, at), top_k=1,
                                      temperature=self.rl.temperature)
            logp = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
            top1 = torch.full(labels.shape, -1, dtype=torch.int64, device=labels.device)
            logp[at], top1[at] = got.logprobs.float(), got.topk_ids[:, 0].long()
            mb.extras["teacher_logp"] = logp.reshape(mb.labels.shape)
            mb.extras["teacher_top1"] = top1.reshape(mb.labels.shape)


class OnPolicyDistillObjective(GRPOObjective):
    """GRPO's surrogate with the teacher's per-token advantage (module docstring)."""

    name: ClassVar[str] = "distill"
    sums: ClassVar[tuple[str, ...]] = GRPOObjective.sums + ("teacher_kl_sum", "teacher_top1_sum")
    shown_metrics: ClassVar[tuple[MetricDisplay, ...]] = (
        MetricDisplay("reverse_kl", label="KL(student || teacher) per sampled token", console="kl", format=".4f"),
        MetricDisplay("teacher_top1", label="sampled tokens the teacher ranks first", console="top1", format=".3f"),
        MetricDisplay("mismatch_kl", label="mismatch KL (engine || trainer)", console="mismatch", format=".1e"))

    @classmethod
    def from_recipe(cls, config: RecipeConfig) -> "OnPolicyDistillObjective":
        grpo = GRPOObjective.from_recipe(config)
        return cls(**{f.name: getattr(grpo, f.name) for f in dataclasses.fields(grpo)})

    def advantages(self, microbatch: Microbatch, old: torch.Tensor, mask: torch.Tensor,
                   logs: dict[str, Any]) -> torch.Tensor:
        ex = microbatch.extras
        adv = (ex["teacher_logp"] - old) * mask
        logs["teacher_kl_sum"] = -adv.sum().detach()
        logs["teacher_top1_sum"] = ((ex["teacher_top1"] == microbatch.labels).float() * mask).sum()
        return adv

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        out = super().metrics(sums)
        tokens = sums["completion_tokens"]
        out["reverse_kl"] = sums["teacher_kl_sum"] / tokens if tokens else float("nan")
        out["teacher_top1"] = sums["teacher_top1_sum"] / tokens if tokens else float("nan")
        return out


__all__ = ["TeacherRollouts", "OnPolicyDistillObjective"]
