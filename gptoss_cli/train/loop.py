"""The training loop of one rank: setup, resume, steps through the selected schedule, checkpoints, metrics.

`TrainJob` is everything a worker needs: the recipe's typed config, resolved in the launching
process (plain, picklable data). `run_worker(job, progress)` joins the process group, trains and returns
a `TrainResult`; only rank 0 calls `progress(event)` (the CLI renders it), every rank's metrics go
to `<run_dir>/metrics.jsonl` (written by rank 0 from an all-gather, one line per rank and step).
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from gptoss_cli.checkpoint.training_format import RUN_KEY, base_fingerprint, read_train_state, require_same_base, run_record
from gptoss_cli.errors import CheckpointError, TrainingError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.model.hybrid import IGNORE_INDEX, lm_loss_sum
from gptoss_cli.parallel.grads import get_attr_wrapped_model, get_model_config
from gptoss_cli.parallel.state import ParallelState, all_gather, barrier, destroy_parallel, init_parallel
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint
from gptoss_cli.train.data import DataLoaderState, Microbatch, build_source
from gptoss_cli.train.heartbeat import Heartbeat
from gptoss_cli.train.optimizer import WarmupCosineLR
from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig
from gptoss_cli.train.setup import setup_model_and_optimizer

Progress = Callable[[dict[str, Any]], None]


@dataclass
class TrainJob:
    """A resolved training run: the recipe's typed config and what was resolved from it.

    `config` is the one source of every setting and default (gptoss_cli/recipe/schema.py); the
    worker reads its sections directly. Plain, picklable data: it travels to spawned workers."""

    config: RecipeConfig
    arch: GptOssArch
    hybrid_layer_pattern: str
    name: str
    run_dir: str
    recipe: dict[str, Any] = field(default_factory=dict)  # the resolved recipe as plain data, for the run dir
    heartbeat_dir: str | None = None  # set by the local launcher, whose watchdog reads the beats

    def run_record(self, lora_base: dict[str, Any] | None = None) -> dict[str, Any]:
        """What every checkpoint of this run records about it (gptoss_cli/checkpoint/training_format.py);
        a LoRA run adds its settings and `lora_base`, the fingerprint of its frozen base."""
        lo = self.config.lora
        lora = None if lo.rank == 0 else {
            "rank": lo.rank, "alpha": float(lo.alpha), "dropout": float(lo.dropout),
            "target_modules": list(lo.target_modules), "base": lora_base}
        return run_record(arch=self.arch, hybrid_layer_pattern=self.hybrid_layer_pattern,
                          params_dtype=self.config.precision.params_dtype, name=self.name, run_dir=self.run_dir,
                          recipe=self.recipe, pretrained=self.config.checkpoint.pretrained, lora=lora)

    @classmethod
    def from_recipe(cls, recipe: Any) -> "TrainJob":
        """From a loaded `gptoss_cli.recipe.load.Recipe`."""
        cfg = recipe.config
        name = cfg.name or (recipe.path.stem if recipe.path else "run")
        return cls(config=cfg, arch=recipe.arch, hybrid_layer_pattern=recipe.pattern.text, name=name,
                   run_dir=str(Path(cfg.logging.run_dir or Path("runs") / name)), recipe=recipe.to_dict())


@dataclass
class TrainResult:
    steps: int  # optimizer steps done by this run
    final_step: int  # global step count reached
    losses: list[float]
    grad_norms: list[float]
    tokens_per_s: float
    run_dir: str
    checkpoint: str | None
    resumed_from: str | None
    world_size: int
    ep_size: int
    fp8: dict[str, Any] | None = None  # recipe, format, path (native/emulated), kernel, FP8 GEMMs run (rank 0)
    notes: list[str] = field(default_factory=list)  # e.g. leftovers of killed runs that were removed


def forward_step(data_iterator: Iterator[Microbatch], model: torch.nn.Module,
                 return_schedule_plan: bool = False) -> tuple[Any, Callable[[Any], tuple[torch.Tensor, torch.Tensor, dict]]]:
    """Megatron's forward_step contract: one microbatch -> (model output, loss_func).

    With `return_schedule_plan` (the overlap schedule asks for it) the output is the model's
    schedule plan for the microbatch instead of its forward; the schedule runs the plan and calls
    loss_func on its output. Either way the schedule decides when the loss is computed."""
    mb = next(data_iterator)
    loss_func = functools.partial(microbatch_loss, mb.labels, get_model_config(model).aux_loss_coeff)
    if return_schedule_plan:
        return get_attr_wrapped_model(model, "build_schedule_plan")(mb.tokens), loss_func
    return model(mb.tokens), loss_func


def microbatch_loss(labels: torch.Tensor, aux_coeff: float, output: Any) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(summed token cross-entropy + aux loss scaled by the microbatch's tokens, tokens, logs)."""
    lm_sum = lm_loss_sum(output, labels)  # chunked over tokens for HybridOutput (model/hybrid.py)
    num_tokens = (labels != IGNORE_INDEX).sum()
    loss_sum = lm_sum
    logs: dict[str, Any] = {"lm_loss_sum": lm_sum.detach()}
    if output.aux_loss is not None and aux_coeff > 0:
        # The aux loss is a per-microbatch mean; weighting it by the microbatch's tokens keeps the
        # global per-token normalisation in finalize_model_grads exact.
        loss_sum = lm_sum + aux_coeff * output.aux_loss * num_tokens
        logs["aux_loss"] = output.aux_loss.detach()
    return loss_sum, num_tokens, logs


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


class MetricsWriter:
    """Rank 0 appends one JSON line per rank and step to metrics.jsonl (gathered from all ranks)."""

    FIELDS = ("lm_loss_sum", "num_tokens", "step_time_s")

    def __init__(self, run_dir: Path, state: ParallelState):
        self.state = state
        self.path = run_dir / "metrics.jsonl"
        if state.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, common: dict[str, Any], local: list[float]) -> None:
        row = torch.tensor(local, dtype=torch.float64, device=self.state.device)
        if self.state.distributed:
            rows = torch.empty(self.state.world_size * len(local), dtype=torch.float64, device=self.state.device)
            all_gather(rows, row, dist.group.WORLD)  # one row per rank of the world, in rank order
            rows = rows.view(self.state.world_size, len(local))
        else:
            rows = row[None]
        if self.state.rank != 0:
            return
        with self.path.open("a") as fh:
            for r, values in enumerate(rows.tolist()):
                local_d = dict(zip(self.FIELDS, values))
                local_loss = local_d["lm_loss_sum"] / max(local_d["num_tokens"], 1)
                fh.write(json.dumps({"step": step, "rank": r, **common, "rank_loss": local_loss,
                                     "rank_tokens": int(local_d["num_tokens"]),
                                     "rank_step_time_s": local_d["step_time_s"]}) + "\n")


def _lora_base(cfg: RecipeConfig, state: ParallelState) -> dict[str, Any] | None:
    """The fingerprint of a LoRA run's frozen base (checkpoint.pretrained), hashed once on rank 0 and
    shared, so every rank records and checks the same one; None without LoRA."""
    if cfg.lora.rank == 0:
        return None
    record = [base_fingerprint(cfg.checkpoint.pretrained) if state.rank == 0 else None]
    if state.distributed:
        dist.broadcast_object_list(record, src=0)
    return record[0]


def check_resume_base(folder: Path, lora_base: dict[str, Any] | None) -> None:
    """Resuming a LoRA run needs a LoRA checkpoint of the same base (and a full run a full checkpoint)."""
    saved = read_train_state(folder).get(RUN_KEY)
    saved_lora = saved.get("lora") if isinstance(saved, dict) else None
    if (saved_lora is None) != (lora_base is None):
        what = "LoRA adapters" if saved_lora is not None else "a full fine-tune (no adapters)"
        raise CheckpointError(
            f"{folder}: holds {what}, but this run is {'a LoRA run' if lora_base else 'a full fine-tune'}",
            hint="resume with the recipe that wrote it, or start in a new checkpoint.dir")
    if lora_base is not None:
        require_same_base(saved_lora.get("base") if isinstance(saved_lora, dict) else None, lora_base, folder)


def run_worker(job: TrainJob, progress: Progress | None = None) -> TrainResult:
    """Train on this process (rank from the torchrun environment, or a single process)."""
    if os.environ.get("OMP_NUM_THREADS") is None and "LOCAL_WORLD_SIZE" in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    owns_group = not dist.is_initialized()
    cfg = job.config
    rank = int(os.environ.get("RANK", "0"))
    # Under torchrun (no launcher watchdog) each rank watches its own progress.
    self_watch = job.heartbeat_dir is None and int(os.environ.get("WORLD_SIZE", "1")) > 1
    heartbeat = Heartbeat(rank, cfg.system.heartbeat_timeout_s, job.heartbeat_dir, self_watch=self_watch).start()
    try:
        state = init_parallel(cfg.parallelism.expert_model_parallel_size, cfg.system.device, cfg.parallelism.backend)
        try:
            return _train(job, state, progress, heartbeat)
        finally:
            if owns_group:
                destroy_parallel()
    finally:
        heartbeat.stop()


def _train(job: TrainJob, state: ParallelState, progress: Progress | None, heartbeat: Heartbeat) -> TrainResult:
    cfg = job.config
    t, ckpt = cfg.training, cfg.checkpoint
    _seed_all(t.seed)
    run_dir = Path(job.run_dir)
    runtime = ModelRuntimeConfig.from_recipe(cfg, job.arch, job.hybrid_layer_pattern)
    provider = HybridModelProvider(runtime, seed=t.seed, weights=ckpt.pretrained)
    setup = setup_model_and_optimizer(provider, state, cfg.optimizer, t.lr,
                                      overlap_grad_reduce=cfg.overlap.overlap_grad_reduce)
    model, optimizer = setup.model, setup.optimizer
    model.train()
    lr_schedule = WarmupCosineLR(t.lr, t.min_lr, t.warmup_iters, t.lr_decay_iters or t.train_iters, t.lr_decay_style)
    source = build_source(cfg.data.kind, path=cfg.data.path, seq_length=t.seq_length, seed=t.seed,
                          vocab_size=job.arch.vocab_size)
    data = DataLoaderState(source, global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                           dp_rank=state.dp_rank, dp_size=state.dp_size, device=state.device)

    lora_base = _lora_base(cfg, state)
    start_step, resumed_from = 0, None
    if ckpt.dir and ckpt.resume:
        folder = latest_checkpoint(ckpt.dir)
        if folder is not None:
            check_resume_base(folder, lora_base)
            meta = load_checkpoint(folder, model=model.module, optimizer=optimizer, state=state)
            start_step = int(meta["step"])
            data.consumed_samples = int(meta["consumed_samples"])
            resumed_from = str(folder)
    if state.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.json").write_text(json.dumps(job.recipe, indent=2, default=str) + "\n")
    metrics = MetricsWriter(run_dir, state)
    schedule = get_forward_backward_func(setup.config)
    fp8 = setup.config.fp8_gemms  # the FP8 gemms the provider selected: which path runs, what ran
    emit = progress if (progress is not None and state.rank == 0) else None
    if emit:
        emit({"kind": "start", "start_step": start_step, "train_iters": t.train_iters, "world_size": state.world_size,
              "ep_size": state.ep_size, "resumed_from": resumed_from, "fp8": fp8.describe() if fp8 else None})

    losses: list[float] = []
    norms: list[float] = []
    tokens_total, time_total = 0.0, 0.0
    last_ckpt = None
    for step in range(start_step, t.train_iters):
        heartbeat.progress(step + 1, "step")
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        logs = schedule(forward_step_func=forward_step, data_iterator=heartbeat.beating(data.step_iterator(), step + 1),
                        model=model, num_microbatches=data.num_microbatches, forward_only=False)
        local = torch.stack([sum(l["lm_loss_sum"].float() for l in logs),
                             sum(l["num_tokens"].float() for l in logs)]).to(torch.float64)
        totals = local.clone()
        if state.distributed:
            dist.all_reduce(totals, group=state.dp_group)
        loss = float(totals[0] / totals[1])
        if not math.isfinite(loss):
            raise TrainingError(
                f"loss is {loss} at step {step + 1}; stopping before the optimizer step (no checkpoint of this state)",
                hint="lower training.lr, enable optimizer.clip_grad, or check the data",
            )
        lr = lr_schedule.lr_at(step)
        grad_norm = optimizer.step(lr)
        if state.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tokens = float(totals[1])
        if step > start_step or t.train_iters - start_step == 1:  # the first step warms up: not in the average
            tokens_total += tokens
            time_total += dt
        losses.append(loss)
        norms.append(grad_norm)
        done = step + 1
        common = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens / dt,
                  "step_time_s": dt, "consumed_samples": data.consumed_samples}
        if fp8 is not None:
            common["fp8"] = fp8.summary()
        metrics.write(done, common, [float(local[0]), float(local[1]), dt])
        if emit and (done % cfg.logging.log_interval == 0 or done == t.train_iters):
            emit({"kind": "step", "step": done, **common})
        if ckpt.dir and (
            done == t.train_iters or (ckpt.save_interval and done % ckpt.save_interval == 0)
        ):
            heartbeat.progress(done, "checkpoint save", watched=False)  # disks may be slow; a stopped rank still shows
            last_ckpt = save_checkpoint(
                ckpt.dir, step=done, model=model.module, optimizer=optimizer, state=state,
                train_state={"consumed_samples": data.consumed_samples, "lr_schedule": lr_schedule.state_dict(),
                             "name": job.name, RUN_KEY: job.run_record(lora_base)},
            )
            if emit:
                emit({"kind": "checkpoint", "step": done, "path": str(last_ckpt)})
    heartbeat.progress(t.train_iters, "finishing", watched=False)
    barrier()
    result = TrainResult(
        steps=len(losses), final_step=max(start_step, t.train_iters), losses=losses, grad_norms=norms,
        tokens_per_s=(tokens_total / time_total) if time_total else 0.0, run_dir=str(run_dir),
        checkpoint=str(last_ckpt) if last_ckpt else None, resumed_from=resumed_from,
        world_size=state.world_size, ep_size=state.ep_size, fp8=fp8.summary() if fp8 else None,
    )
    if emit:
        emit({"kind": "end", **asdict(result)})
    return result


__all__ = ["TrainJob", "TrainResult", "run_worker", "forward_step", "MetricsWriter"]
