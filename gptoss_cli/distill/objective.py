"""Distillation's training objective on the data section's token files (distill.on_policy=false).

Per trained token (labels != IGNORE_INDEX): `(1 - ce_weight) D + ce_weight CE`, D the divergence of
distill.loss between the student's and the teacher's distributions at that position
(gptoss_cli/distill/losses.py: the full vocabulary, or the teacher's top-K and tail), CE the ordinary
cross-entropy; summed over the microbatch, normalised by its trained tokens, as cross-entropy is, plus
the router's aux and z-losses at the recipe's coefficients.

The teacher reaches `loss` through the microbatch (train/objective.py: `loss` depends on the microbatch
and the output only): `prepare_step` hands each microbatch to the teacher (`teacher.attach`,
gptoss_cli/distill/teacher.py), which puts its top-K and tail, or its final hidden states, into
`extras`. The teacher is bound by the run's Trainer (gptoss_cli/distill/trainer.py) once it is built;
microbatches are handed over one at a time, so a model teacher's forward runs right before the
student's, in the same order on every rank (its expert all-to-alls match across the EP group).

Metrics: `loss`; `distill_loss` (the mean D); `ce_loss` (the mean CE, whatever ce_weight); `kl_teacher`,
KL(teacher || student) per token over the outcomes D is computed on; `top1_agreement`, the share of
trained tokens whose most likely token is the same for student and teacher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterator

import torch

from gptoss_cli.distill.losses import CHUNK_DIVISOR, Divergence, distill_terms
from gptoss_cli.distill.teacher import TEACHER_HIDDEN
from gptoss_cli.model.loss import IGNORE_INDEX, HybridOutput
from gptoss_cli.model.loss_chunk import lm_loss_chunk_tokens
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.train.data import Microbatch
from gptoss_cli.train.objective import StepContext, TrainingObjective, router_losses
from gptoss_cli.train.progress import MetricDisplay

if TYPE_CHECKING:
    from gptoss_cli.train.provider import ModelRuntimeConfig

KL_TEACHER = MetricDisplay("kl_teacher", label="KL(teacher || student) per token", console="kl", format=".4f")


def _score_extras() -> dict[str, str]:
    from gptoss_cli.score.reader import EXTRAS  # noqa: PLC0415

    return EXTRAS


@dataclass
class DistillObjective(TrainingObjective):
    """Offline distillation (see the module docstring); `teacher` is bound by the Trainer."""

    divergence: Divergence = Divergence()
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    teacher: Any = None  # ScoreTeacher | ModelTeacher (gptoss_cli/distill/teacher.py)
    name: ClassVar[str] = "distill"
    sums: ClassVar[tuple[str, ...]] = ("loss_sum", "num_tokens", "distill_sum", "ce_sum", "kl_teacher_sum",
                                       "top1_sum", "aux_loss_sum", "z_loss_sum")
    shown_metrics: ClassVar[tuple[MetricDisplay, ...]] = (
        KL_TEACHER,
        MetricDisplay("top1_agreement", label="top-1 agreement with the teacher", console="top1", format=".3f"))

    @classmethod
    def from_recipe(cls, config: RecipeConfig) -> "DistillObjective":
        d = config.distill
        return cls(Divergence(d.loss, d.jsd_beta, d.temperature, d.ce_weight), config.moe.aux_loss_coeff,
                   config.moe.z_loss_coeff)

    def __getstate__(self) -> dict[str, Any]:  # travels to spawned workers without a teacher
        return {**self.__dict__, "teacher": None}

    def prepare_step(self, microbatches: Iterator[Microbatch], context: StepContext) -> Iterator[Microbatch]:
        if self.teacher is None:
            raise RuntimeError("DistillObjective.teacher is not bound: the distill Trainer binds it")
        return (self.teacher.attach(mb) for mb in microbatches)

    def loss(self, microbatch: Microbatch, config: ModelRuntimeConfig, output: HybridOutput
             ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        labels, ex = microbatch.labels, microbatch.extras
        hidden = output.hidden.reshape(-1, output.hidden.shape[-1])
        chunk = max(1, lm_loss_chunk_tokens(output.head_weight.shape[0], hidden.element_size(),
                                            hidden.device.type) // CHUNK_DIVISOR)
        names = _score_extras()
        flat = lambda t: t.reshape(-1, *t.shape[labels.dim():])  # noqa: E731
        if TEACHER_HIDDEN in ex:
            teacher = dict(teacher_hidden=flat(ex[TEACHER_HIDDEN]), teacher_weight=self.teacher.head_weight)
        else:
            teacher = dict(teacher_topk=tuple(flat(ex[names[k]]) for k in ("topk_ids", "topk_logprobs",
                                                                           "tail_logmass")))
        terms = distill_terms(hidden, output.head_weight, labels, labels != IGNORE_INDEX, self.divergence, chunk,
                              **teacher)
        logs: dict[str, Any] = {"distill_sum": terms.divergence, "ce_sum": terms.ce, "kl_teacher_sum": terms.kl_teacher,
                                "top1_sum": terms.top1}
        num_tokens = terms.tokens
        loss_sum = terms.loss + router_losses(output, num_tokens, self.aux_loss_coeff, self.z_loss_coeff, logs)
        return loss_sum, num_tokens, logs

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        tokens = sums["num_tokens"]

        def per(name: str) -> float:
            return sums[name] / tokens if tokens else float("nan")

        w = self.divergence.ce_weight
        out = {"loss": (1 - w) * per("distill_sum") + w * per("ce_sum"), "tokens": tokens,
               "distill_loss": per("distill_sum"), "ce_loss": per("ce_sum"), "kl_teacher": per("kl_teacher_sum"),
               "top1_agreement": per("top1_sum")}
        for name, coeff in (("aux_loss", self.aux_loss_coeff), ("z_loss", self.z_loss_coeff)):
            if coeff > 0:
                out[name] = per(f"{name}_sum")
        return out


__all__ = ["DistillObjective", "KL_TEACHER"]
