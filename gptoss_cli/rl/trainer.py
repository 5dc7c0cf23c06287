"""GRPO training: the Trainer (train/loop.py) with rollouts as its data.

`RLTrainer` is the loop's Trainer with three differences: its data is `RolloutData` (rl/rollouts.py)
instead of token files, its objective is GRPO (rl/objective.py; the two are objective.kind=grpo's
row in gptoss_cli/run/objectives.py), and before the first step of each rollout batch it brings the
engine up to date with the policy and samples (`train_step`). Everything else (schedule, gradient
finalisation, optimizer, metrics.jsonl, checkpoints, resume) is the loop's own. A rollout batch is
trained by rl.steps_per_rollout steps of training.global_batch_size completions each; after the last of
them, with rl.save_rollouts, the rollout is written to logging.run_dir/rollouts/ (rl/rollout_save.py).

Checkpoints fall on rollout boundaries (rule rl.checkpoints), where nothing of a rollout is pending;
train_state.json's `rl` entry records the rollouts done (the prompt cursor, from which the sampling
seeds derive), the engine's weights version and what must not change across a resume (prompts,
reward, seed, group size).
"""

from __future__ import annotations

import time
from typing import Any

from gptoss_cli.checkpoint.formats.training.record import iter_name
from gptoss_cli.errors import GptossError
from gptoss_cli.rl.rollouts import RolloutData
from gptoss_cli.train.loop import StepOutcome, Trainer
from gptoss_cli.train.objective import StepContext
from gptoss_cli.train.progress import RunWarning


class RLTrainer(Trainer):
    """The Trainer for objective.kind=grpo (see the module docstring)."""

    def _build_data(self) -> RolloutData:  # called by Trainer.__init__ once the model is built
        self.packing = None
        return RolloutData(self.job, self.state, self.model, self.heartbeat)

    def resume(self) -> None:
        super().resume()
        self.data.resumed(self.start_step, self.resumed_meta)

    def train_step(self, step: int) -> StepOutcome:
        rl = self.cfg.rl
        k = step % rl.steps_per_rollout
        if k == 0 or self.data.rollout is None:
            self.heartbeat.progress(step + 1, "rollout")
            # forward-only scoring through the plain schedule (the overlap schedule's plans are for training)
            context = StepContext(step=step, model=self.model, state=self.state)
            try:
                self.data.sample(step // rl.steps_per_rollout, version=step, context=context,
                                 beat=lambda: self.heartbeat.progress(step + 1, "rollout"))
            except GptossError as exc:
                raise self._saved_before_stopping(exc, step) from None
        self.data.step_in_rollout = k
        t0 = time.perf_counter()
        out = super().train_step(step)
        out.metrics.update(self.data.step_metrics(k, train_seconds=time.perf_counter() - t0))
        if rl.save_rollouts and k == rl.steps_per_rollout - 1:  # every completion of the rollout is trained on
            self._save_rollout(step - k + 1)
        self._warn_mismatch(out)
        return out

    def _save_rollout(self, first_step: int) -> None:
        """rl.save_rollouts: the rollout's file, written by rank 0 (rl/rollout_save.py)."""
        from gptoss_cli.rl.importance import ImportanceCorrection
        from gptoss_cli.rl.rollout_save import save_rollout

        rl = self.cfg.rl
        correction = getattr(self.objective, "correction", None) or ImportanceCorrection(
            rl.is_correction, rl.is_min, rl.is_max, rl.is_sequence_ratio)
        save_rollout(self.data, self.data.rollout, first_step, correction, self.job.run_dir)

    def _saved_before_stopping(self, exc: GptossError, step: int) -> GptossError:
        """A rollout that cannot go on (the engine failed its check or died, every reward failed) stops the run; the
        policy trained so far is saved first where checkpoint.dir is set (every rank: it is a collective), at
        `step`, a rollout boundary. The error again, its hint naming the checkpoint."""
        if not self.cfg.checkpoint.dir or step <= self.start_step:
            return exc  # nothing trained since the run started (or since the checkpoint it resumed)
        if self.state.distributed and not getattr(exc, "every_rank", False):
            return exc  # raised on one rank: the others could not join the save
        if self.last_checkpoint is None or self.last_checkpoint.name != iter_name(step):
            self.save_checkpoint(step)
        saved = f"the policy after step {step} is saved in {self.last_checkpoint} (the same command resumes from it)"
        return type(exc)(exc.message, hint=f"{exc.hint}; {saved}" if exc.hint else saved)

    def started_notes(self) -> list[str]:
        return self.data.started_notes()

    def _warn_mismatch(self, out: StepOutcome) -> None:
        threshold = self.cfg.rl.rollout.mismatch_warn
        value = out.metrics.get("mismatch_kl")
        if self.emit and value is not None and value > threshold:
            self.emit(RunWarning(step=out.step, message=(
                f"mismatch_kl {value:.3g} per token (above rl.rollout.mismatch_warn={threshold:g}): the rollout "
                f"engine's log-probabilities part from the trainer's; likely source: {self.data.mismatch_suspects()}")))
        for line in self.data.take_warnings():
            if self.emit:
                self.emit(RunWarning(step=out.step, message=line))

    def extra_train_state(self) -> dict[str, Any]:
        return {"rl": self.data.state_dict()}

    def checkpoint_boundary(self, done: int) -> bool:
        """Checkpoints fall on rollout boundaries (a save on a signal waits for the next one)."""
        return done % self.cfg.rl.steps_per_rollout == 0

    def close(self) -> None:
        self.data.close()


__all__ = ["RLTrainer"]
