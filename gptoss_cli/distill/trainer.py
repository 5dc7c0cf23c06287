"""The Trainer and objective of objective.kind=distill (its row in gptoss_cli/run/objectives.py), per mode.

- offline (distill.on_policy=false): the loop's own Trainer on the data section's token files, the
  teacher (gptoss_cli/distill/teacher.py) opened once the student is built and bound to the objective
  (gptoss_cli/distill/objective.py), which hands it each microbatch;
- on-policy: GRPO's RLTrainer (rl/trainer.py) whose rollouts are `TeacherRollouts`, the teacher built
  before the first rollout (gptoss_cli/distill/on_policy.py).

Either way train_state.json's `distill` entry records where the teacher came from.
"""

from __future__ import annotations

from typing import Any

from gptoss_cli.distill.objective import DistillObjective
from gptoss_cli.distill.on_policy import OnPolicyDistillObjective, TeacherRollouts
from gptoss_cli.distill.teacher import open_teacher
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.rl.trainer import RLTrainer
from gptoss_cli.train.loop import Trainer
from gptoss_cli.train.objective import TrainingObjective


def teacher_record(cfg: RecipeConfig) -> dict[str, Any]:
    d = cfg.distill
    return {"teacher": d.teacher, "teacher_checkpoint": d.teacher_checkpoint, "scores": d.scores, "top_k": d.top_k,
            "loss": d.loss, "temperature": d.temperature, "on_policy": d.on_policy}


class DistillTrainer(Trainer):
    """Offline distillation: the loop's Trainer with the teacher bound to the objective."""

    def __init__(self, job, state, **kwargs: Any):
        super().__init__(job, state, **kwargs)
        self.teacher = open_teacher(self.cfg, job.arch, state)
        self.objective.teacher = self.teacher

    def extra_train_state(self) -> dict[str, Any]:
        return {"distill": teacher_record(self.cfg)}

    def close(self) -> None:
        self.teacher.close()


class OnPolicyDistillTrainer(RLTrainer):
    """On-policy distillation: GRPO's Trainer sampling TeacherRollouts."""

    def _build_data(self) -> TeacherRollouts:  # called by Trainer.__init__ once the student is built
        self.packing = None
        self.teacher = open_teacher(self.cfg, self.job.arch, self.state)
        return TeacherRollouts(self.job, self.state, self.model, self.heartbeat, teacher=self.teacher)

    def extra_train_state(self) -> dict[str, Any]:
        return {**super().extra_train_state(), "distill": teacher_record(self.cfg)}

    def close(self) -> None:
        super().close()
        self.teacher.close()


def distill_objective(config: RecipeConfig) -> TrainingObjective:
    """objective.kind=distill's objective: offline or on-policy, as distill.on_policy says."""
    if config.distill.on_policy:
        return OnPolicyDistillObjective.from_recipe(config)
    return DistillObjective.from_recipe(config)


def distill_trainer(job, state, **kwargs: Any) -> Trainer:
    """objective.kind=distill's Trainer (called as a Trainer class is, gptoss_cli/run/objectives.py)."""
    cls = OnPolicyDistillTrainer if job.config.distill.on_policy else DistillTrainer
    return cls(job, state, **kwargs)


__all__ = ["DistillTrainer", "OnPolicyDistillTrainer", "distill_objective", "distill_trainer", "teacher_record"]
