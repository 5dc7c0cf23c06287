"""The training loop of one rank: the `Trainer` that `run_worker` (gptoss_cli/run/worker.py) runs.

The `Trainer` is built in named steps as torchtitan's is:
`Trainer(job, state)` builds the model, optimizer, data and schedule; `resume()` loads the latest
checkpoint of `checkpoint.dir` (train/resume.py: refusing one whose lr schedule or data blend the
recipe would change); `train_step(step)` runs one optimizer step through the selected schedule
with the job's training objective (train/objective.py) and returns its numbers; `validate(done)`
scores the held-out data when due (train/validation.py); `record_step` writes the step's numbers;
`save_checkpoint(done)` saves (synchronously, or with checkpoint.async_save its upload runs while the next
steps do: train/async_save.py) and a published checkpoint goes through retention; `end_step(done)` is the
ranks' agreement at the step's end (train/stop.py: checkpoint.save_on_signal, the asynchronous save's
state); `train()` runs it all and returns the `TrainResult` (train/progress.py).

Only rank 0 calls `progress(event)` with the typed events of gptoss_cli/train/progress.py (the CLI
renders them); every rank's metrics go to `<run_dir>/metrics.jsonl` (train/metrics.py: written by rank
0 from an all-gather, one line per rank and step; the step's global router telemetry on rank 0's
line, train/telemetry.py), and to TensorBoard / W&B when the recipe asks (train/loggers.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gptoss_cli import outputs
from gptoss_cli.checkpoint.formats.training.record import RUN_KEY, read_train_state
from gptoss_cli.errors import ConfigError, TrainingError
from gptoss_cli.model.pattern import MOE
from gptoss_cli.parallel.state import ParallelState, barrier
from gptoss_cli.recipe.environment import gpu_from_device_name
from gptoss_cli.recipe.estimate.flops import model_flops_per_token, peak_tflops, recompute_flops_per_token, throughput
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.resources import release_freed_heap
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.blend import BlendedSource, blended_source
from gptoss_cli.train.async_save import AsyncCheckpointer
from gptoss_cli.train.checkpointing import latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint
from gptoss_cli.train.data import DataLoaderState, build_source
from gptoss_cli.train.heartbeat import Heartbeat
from gptoss_cli.train.job import TrainJob
from gptoss_cli.train.loggers import Loggers
from gptoss_cli.train.metrics import MetricsWriter
from gptoss_cli.train.objective import StepContext
from gptoss_cli.train.optimizer import WarmupCosineLR
from gptoss_cli.train.progress import (
    CheckpointSaved, StepDone, TrainFinished, TrainProgress, TrainResult, TrainStarted,
)
from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig
from gptoss_cli.train.report import OBJECTIVE, objective_record
from gptoss_cli.train.resume import check_resume_base, check_resume_recipe, lora_base
from gptoss_cli.train.setup import setup_model_and_optimizer
from gptoss_cli.train.stop import StepEnd, stop_exception
from gptoss_cli.train.telemetry import StepTotals
from gptoss_cli.train.validation import Validator


def run_peak_tflops(cfg: RecipeConfig, device: torch.device) -> float | None:
    """The dense peak MFU is measured against: system.gpu's (detected on CUDA when auto), at the FP8
    rate when an FP8 recipe is on; None on CPUs and unknown GPUs."""
    gpu = cfg.system.gpu
    if device.type != "cuda":
        return None
    if gpu == "auto":
        gpu = gpu_from_device_name(torch.cuda.get_device_name(device))
    return peak_tflops(gpu, cfg.precision.fp8_recipe != "none")


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class StepOutcome:
    """One optimizer step's numbers, before they are written."""

    step: int  # steps done after it (1-based)
    metrics: dict[str, float]  # the objective's (loss, tokens, ...), reduced over the data-parallel ranks
    local: dict[str, float]  # the same for this rank's microbatches only
    lr: float
    grad_norm: float
    step_time_s: float
    router: dict[str, Any]  # metrics.jsonl's router fields (rank 0's line)

    @property
    def loss(self) -> float:
        return self.metrics["loss"]


class Trainer:
    """One rank's training run (see the module docstring for its named steps)."""

    def __init__(self, job: TrainJob, state: ParallelState, *, progress: TrainProgress | None = None,
                 heartbeat: Heartbeat | None = None, loggers: Loggers | None = None):
        cfg = job.config
        t = cfg.training
        self.job, self.cfg, self.state, self.loggers = job, cfg, state, loggers
        self.heartbeat = heartbeat or Heartbeat(state.rank, cfg.system.heartbeat_timeout_s)
        self.emit = progress if (progress is not None and state.rank == 0) else None
        self.run_dir = Path(job.run_dir)
        _seed_all(t.seed)
        self.runtime = ModelRuntimeConfig.from_recipe(cfg, job.arch, job.pattern)
        provider = HybridModelProvider(self.runtime, seed=t.seed, weights=cfg.checkpoint.pretrained)
        setup = setup_model_and_optimizer(provider, state, cfg.optimizer, t.lr,
                                          overlap_grad_reduce=cfg.overlap.overlap_grad_reduce)
        self.model, self.optimizer, self.model_config = setup.model, setup.optimizer, setup.config
        self.model.train()
        self.lr_schedule = WarmupCosineLR.from_training(t)
        self.data = self._build_data()
        self.validator = Validator(cfg, state, job.arch.vocab_size) if cfg.validation.data else None
        if job.objective is None:
            raise ValueError("TrainJob.objective is None: run_worker builds the recipe's (gptoss_cli/run/objectives.py)")
        self.objective = job.objective
        self.schedule = get_forward_backward_func(self.model_config)
        # every MoE layer of the model, also those other pipeline stages hold
        self.totals = StepTotals([j for j, s in enumerate(self.model.module.pattern.layers) if s == MOE],
                                 job.arch.num_local_experts, tuple(self.objective.sums))
        self.metrics = MetricsWriter(self.run_dir, state)
        self.fp8 = self.model_config.fp8_gemms  # the FP8 gemms the provider selected: which path runs, what ran
        if self.fp8 is not None:
            self.fp8.guard.deferred = True  # NaN/inf checks recorded on the device, read once per step (train_step)
        self._flops_setup()
        self.lora_base = lora_base(cfg, state)
        self.start_step, self.resumed_from = 0, None
        self.resumed_meta: dict[str, Any] | None = None  # the resumed checkpoint's train_state.json
        self.losses: list[float] = []
        self._shown: dict[str, dict[str, Any]] = {}  # the objective's shown metrics, first and last (the summary)
        self.grad_norms: list[float] = []
        self._timed = [0.0, 0.0, 0]  # tokens, seconds, steps (the first step warms up: not counted)
        self.last_checkpoint: Path | None = None
        self.saved_step: int | None = None  # the step of the last save started by this run
        ckpt = cfg.checkpoint
        self.async_saves = (AsyncCheckpointer(state)
                            if ckpt.dir and ckpt.async_save else None)
        self.step_end = StepEnd(state, save_on_signal=bool(ckpt.dir and ckpt.save_on_signal),
                                async_save=self.async_saves is not None)

    def _build_data(self) -> DataLoaderState:
        t, state, d = self.cfg.training, self.state, self.cfg.data
        if d.kind == "tokens" and d.blend:
            source: Any = blended_source([(b.path, b.weight) for b in d.blend], t.seq_length, t.seed,
                                         self.job.arch.vocab_size)
        else:
            source = build_source(d.kind, path=d.path, seq_length=t.seq_length, seed=t.seed,
                                  vocab_size=self.job.arch.vocab_size)
        self.packing = ({"efficiency": source.efficiency, "rows": source.num_samples, "seq_length": t.seq_length}
                        if getattr(source, "documents", False) else None)
        return DataLoaderState(source, global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                               dp_rank=state.data_parallel_rank, dp_size=state.data_parallel_size, device=state.device,
                               cp_size=state.cp_size, cp_rank=state.cp_rank)

    def _flops_setup(self) -> None:
        job, t = self.job, self.cfg.training
        self.flops_per_token = model_flops_per_token(job.arch, t.seq_length, job.pattern)
        # recompute's repeated forward work: hardware FLOPs, reported apart from the model's
        self.hardware_flops = self.flops_per_token + recompute_flops_per_token(
            job.arch, t.seq_length, job.pattern,
            self.runtime.recompute.layer_pieces(self.model.module.pattern.layers))
        self.peak = run_peak_tflops(self.cfg, self.state.device)
        self.step_tokens = t.global_batch_size * t.seq_length  # every token of the step runs through the model

    # -- resume ----------------------------------------------------------------------------------
    def resume(self) -> None:
        """Load the latest checkpoint of checkpoint.dir (when resuming is on and there is one), write the
        resolved recipe to the run folder, and announce the start."""
        ckpt = self.cfg.checkpoint
        folder = latest_checkpoint(ckpt.dir) if ckpt.dir and ckpt.resume else None
        if folder is not None:
            check_resume_base(folder, self.lora_base)
            check_resume_recipe(folder, read_train_state(folder), self.cfg)
            meta = load_checkpoint(folder, model=self.model.module, optimizer=self.optimizer, state=self.state)
            self.start_step = int(meta["step"])
            self.data.consumed_samples = int(meta["consumed_samples"])
            self._resume_blend(folder, meta.get("blend"))
            self.resumed_from, self.resumed_meta = str(folder), meta
        if self.state.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            outputs.replace_text(self.run_dir / "recipe.json", json.dumps(self.job.recipe, indent=2, default=str) + "\n")
            # which of the objective's metrics report shows, and how (it knows none by name)
            record = objective_record(getattr(self.objective, "name", type(self.objective).__name__),
                                      self.objective.shown_metrics)
            outputs.replace_text(self.run_dir / OBJECTIVE, json.dumps(record, indent=2) + "\n")
        if self.emit:
            self.emit(TrainStarted(start_step=self.start_step, train_iters=self.cfg.training.train_iters,
                                   world_size=self.state.world_size, ep_size=self.state.ep_size,
                                   cp_size=self.state.cp_size, pp_size=self.state.pp_size,
                                   pipeline_schedule=self.cfg.parallelism.pipeline_schedule
                                   if self.state.pp_size > 1 else None, resumed_from=self.resumed_from,
                                   fp8=self.fp8.describe() if self.fp8 else None, packing=self.packing,
                                   qat=self.cfg.precision.qat, shown_metrics=self.objective.shown_metrics,
                                   notes=tuple(self.started_notes())))

    def started_notes(self) -> list[str]:
        """Lines the run's start shows besides the loop's own (a subclass's: GRPO's rollout engine)."""
        return []

    def _resume_blend(self, folder: Path, saved: dict[str, Any] | None) -> None:
        source = getattr(self.data, "source", None)
        if self.cfg.checkpoint.override_data and not (isinstance(source, BlendedSource) and isinstance(saved, dict)
                                                      and saved.get("files") == source.files):
            saved = None  # other data on purpose: a blend replays its stream up to the position, a file reads on
        if isinstance(source, BlendedSource):
            source.load_state_dict(saved, self.data.consumed_samples, folder)
        elif saved is not None:
            raise ConfigError(f"{folder}: the checkpoint trained on the blend data.blend={saved.get('files')}, this "
                              "recipe trains on data.path", hint="resume with the checkpoint's data.blend, or start "
                              "a new checkpoint.dir")

    # -- one step --------------------------------------------------------------------------------
    def train_step(self, step: int) -> StepOutcome:
        """Optimizer step `step` (0-based: steps done before it): the schedule over the step's
        microbatches, the objective's sums reduced in one collective and read back once, a finite
        loss checked, then the optimizer."""
        self.heartbeat.progress(step + 1, "step")
        t0 = time.perf_counter()
        self.model.zero_grad_buffer()
        context = StepContext(step=step, model=self.model, state=self.state, schedule=self.schedule)
        microbatches = self.objective.prepare_step(self.data.step_iterator(), context)
        logs = self.schedule(forward_step_func=self.objective.forward_step,
                             data_iterator=self.heartbeat.beating(microbatches, step + 1),
                             model=self.model, num_microbatches=self.data.num_microbatches, forward_only=False)
        local = self.totals.vector(logs, self.state.device)
        totals = local.clone()
        if self.state.distributed:
            # one small collective for every step total, over every rank: with pipeline parallelism
            # the loss sums come from the last stage, each MoE layer's router rows from its own stage
            dist.all_reduce(totals, group=self.state.global_group)
        # The step's one host sync; the FP8 NaN/inf flag (fp8/guard.py) rides on it and is checked first.
        fp8 = self.fp8
        read = torch.cat([local, totals, fp8.guard.flag(self.state.device).view(1) if fp8 else local[:0]]).tolist()
        local_values, values = read[:local.numel()], read[local.numel():2 * local.numel()]
        if fp8 is not None:
            fp8.guard.check(read[-1], step + 1)
        metrics = self.objective.metrics(self.totals.scalars(values))
        if not math.isfinite(metrics["loss"]):
            raise TrainingError(
                f"loss is {metrics['loss']} at step {step + 1}; stopping before the optimizer step "
                "(no checkpoint of this state)",
                hint="lower training.lr, enable optimizer.clip_grad, or check the data",
            )
        lr = self.lr_schedule.lr_at(step)
        grad_norm = self.optimizer.step(lr)
        if self.state.device.type == "cuda":
            torch.cuda.synchronize()
        # a pipeline rank without the last stage computes no loss: nothing of its own to report
        local = (self.objective.metrics(self.totals.scalars(local_values)) if self.model.module.post_process
                 else {"loss": 0.0, "tokens": 0.0})
        return StepOutcome(step=step + 1, metrics=metrics, local=local,
                           lr=lr, grad_norm=grad_norm, step_time_s=time.perf_counter() - t0,
                           router=self.totals.router_record(values))

    def validate(self, done: int) -> dict[str, Any]:
        """The held-out loss after step `done` when validation is on and due (metrics.jsonl fields), else {}."""
        if self.validator is None or not self.validator.due(done):
            return {}
        self.heartbeat.progress(done, "validation")
        return self.validator.run(self.model, beat=lambda: self.heartbeat.progress(done, "validation"))

    def record_step(self, out: StepOutcome, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The step's metrics.jsonl lines (with `extra`, e.g. the validation fields), loggers and progress
        event; returns its global fields."""
        t, dt = self.cfg.training, out.step_time_s
        tokens = out.metrics["tokens"]
        if out.step - 1 > self.start_step or t.train_iters - self.start_step == 1:  # the first step warms up
            self._timed[0] += tokens
            self._timed[1] += dt
            self._timed[2] += 1
        self.losses.append(out.loss)
        self.grad_norms.append(out.grad_norm)
        tflops, mfu = throughput(self.flops_per_token, self.step_tokens / dt, self.state.world_size, self.peak)
        common = {"loss": out.loss, "lr": out.lr, "grad_norm": out.grad_norm, "tokens_per_s": tokens / dt,
                  "step_time_s": dt, "consumed_samples": self.data.consumed_samples,
                  "model_flops_per_token": self.flops_per_token, "tflops_per_gpu": tflops, "mfu": mfu,
                  "hardware_tflops_per_gpu": tflops * self.hardware_flops / self.flops_per_token,
                  **{k: v for k, v in out.metrics.items() if k not in ("loss", "tokens")}, **(extra or {})}
        if self.fp8 is not None:
            common["fp8"] = self.fp8.summary()
        local_tokens = out.local["tokens"]
        rank_loss = out.local["loss"] if local_tokens else 0.0
        records = self.metrics.write(out.step, common, [rank_loss, local_tokens, dt], rank0=out.router)
        if self.loggers is not None:
            self.loggers.log(out.step, records)
        self._follow_shown(common)
        if self.emit and (out.step % self.cfg.logging.log_interval == 0 or out.step == t.train_iters):
            # every other number of the line by name (the objective's, its Trainer's, a validation's
            # beyond val_loss): the loop knows none of them
            objective = {k: v for k, v in {**out.metrics, **(extra or {})}.items()
                         if k not in STEP_FIELDS and k != "tokens" and isinstance(v, (int, float))
                         and not isinstance(v, bool)}
            self.emit(StepDone(step=out.step, objective_metrics=objective,
                               **{k: v for k, v in common.items() if k in STEP_FIELDS}))
        return common

    def _follow_shown(self, values: dict[str, Any]) -> None:
        """The first and last value of each of the objective's shown metrics, for the run's summary."""
        for m in self.objective.shown_metrics:
            v = values.get(m.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                entry = self._shown.setdefault(m.name, {"name": m.name, "label": m.label, "format": m.format, "first": v})
                entry["last"] = v

    # -- checkpoints -----------------------------------------------------------------------------
    def should_save(self, done: int) -> bool:
        ckpt = self.cfg.checkpoint
        return bool(ckpt.dir) and (done == self.cfg.training.train_iters
                                   or bool(ckpt.save_interval and done % ckpt.save_interval == 0))

    def checkpoint_boundary(self, done: int) -> bool:
        """Whether a checkpoint may be taken after step `done` (a subclass with state inside a step group says
        no there: GRPO inside a rollout); a save on a signal waits for the next boundary."""
        return True

    def save_checkpoint(self, done: int, reason: str | None = None) -> Path | None:
        """Checkpoint `iter_{done}` with the data position, the lr schedule and the run record; with
        checkpoint.async_save its upload is started (the folder is published later: train/async_save.py).
        Returns the folder published now, if any. `reason`: why, when not the schedule ("signal")."""
        ckpt = self.cfg.checkpoint
        self.heartbeat.progress(done, "checkpoint save", watched=False)  # disks may be slow; a stopped rank still shows
        train_state = {"consumed_samples": self.data.consumed_samples, "lr_schedule": self.lr_schedule.state_dict(),
                       "name": self.job.name, RUN_KEY: self.job.run_record(self.lora_base)}
        if reason:
            train_state["saved_on"] = reason
        if isinstance(getattr(self.data, "source", None), BlendedSource):
            train_state["blend"] = self.data.source.state_dict(self.data.consumed_samples)
        train_state.update(self.extra_train_state())
        self.saved_step = done
        if self.async_saves is not None:  # the save before it is finished (and published) first
            return self._published(self.async_saves.save(ckpt.dir, step=done, model=self.model.module,
                                                         optimizer=self.optimizer, train_state=train_state))
        return self._published(save_checkpoint(ckpt.dir, step=done, model=self.model.module, optimizer=self.optimizer,
                                               state=self.state, train_state=train_state))

    def _published(self, folder: Path | None) -> Path | None:
        """A checkpoint now complete and named by `latest`: retention, and the progress event."""
        if folder is None:
            return None
        ckpt = self.cfg.checkpoint
        self.last_checkpoint = folder
        removed = prune_checkpoints(ckpt.dir, ckpt.keep_last, ckpt.keep_every) if self.state.rank == 0 else []
        if self.emit:
            self.emit(CheckpointSaved(step=int(folder.name[len("iter_"):]), path=str(folder),
                                      removed=[str(p) for p in removed]))
        return folder

    def end_step(self, done: int) -> None:
        """The ranks' agreement at the end of step `done` (train/stop.py): an asynchronous save published or
        failed, and with checkpoint.save_on_signal a signal seen by any rank: the step saved, the run stopped."""
        if not self.step_end.active:
            return
        running, failed = self.async_saves.local_state() if self.async_saves is not None else (0, 0)
        agreed = self.step_end.agree(running, failed)
        if self.async_saves is not None:
            self._published(self.async_saves.settle(agreed.running, agreed.failed))
        if agreed.signum and self.checkpoint_boundary(done):
            if self.cfg.checkpoint.dir and self.saved_step != done:
                self.save_checkpoint(done, reason="signal")
            if self.async_saves is not None:
                self._published(self.async_saves.wait())
            raise stop_exception(agreed.signum)

    def extra_train_state(self) -> dict[str, Any]:
        """What a subclass saves in train_state.json besides the loop's own (it comes back as resumed_meta)."""
        return {}

    def close(self) -> None:
        """Release what the run holds besides the process group (a subclass's engines)."""

    # -- the run ---------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Steps from the resumed one to training.train_iters, saving as checkpoint.* says; the result.
        A save still in flight when the run stops is finished or removed (train/async_save.py, `abandon`)."""
        t = self.cfg.training
        saves = self.async_saves.guarded() if self.async_saves is not None else contextlib.nullcontext()
        with self.step_end.watching(), saves:
            for step in range(self.start_step, t.train_iters):
                outcome = self.train_step(step)
                self.record_step(outcome, self.validate(step + 1))
                if self.state.device.type == "cpu":
                    release_freed_heap()  # the heap's free pages back to the OS (resources.py says why)
                if self.should_save(step + 1):
                    self.save_checkpoint(step + 1)
                self.end_step(step + 1)
            self.heartbeat.progress(t.train_iters, "finishing", watched=False)
            if self.async_saves is not None:
                self._published(self.async_saves.wait())  # the last save completes before the run ends
            self.end_step(max(self.start_step, t.train_iters))  # a signal during the last save still stops it
        barrier()
        result = self.result()
        if self.emit:
            self.emit(TrainFinished(result))
        return result

    def result(self) -> TrainResult:
        tokens, seconds, steps = self._timed
        tflops, mfu = throughput(self.flops_per_token, self.step_tokens * steps / seconds if seconds else 0.0,
                                 self.state.world_size, self.peak)
        return TrainResult(
            steps=len(self.losses), final_step=max(self.start_step, self.cfg.training.train_iters),
            losses=self.losses, grad_norms=self.grad_norms, tokens_per_s=tokens / seconds if seconds else 0.0,
            run_dir=str(self.run_dir), checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
            resumed_from=self.resumed_from, world_size=self.state.world_size, ep_size=self.state.ep_size,
            fp8=self.fp8.summary() if self.fp8 else None, packing=self.packing,
            model_flops_per_token=self.flops_per_token, tflops_per_gpu=tflops, mfu=mfu if seconds else None,
            peak_tflops=self.peak, qat=self.cfg.precision.qat, shown=list(self._shown.values()),
        )


STEP_FIELDS = {f for f in StepDone.__dataclass_fields__ if f not in ("step", "objective_metrics")}

__all__ = ["Trainer", "StepOutcome", "run_peak_tflops"]
