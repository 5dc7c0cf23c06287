"""The training loop of one rank: setup, resume, steps through the selected schedule, checkpoints, metrics.

`TrainJob` is everything a worker needs: the recipe's typed config, resolved in the launching
process (plain, picklable data). `run_worker(job, progress)` joins the process group, trains and returns
a `TrainResult`; only rank 0 calls `progress(event)` with the typed events of gptoss_cli/train/progress.py
(the CLI renders them), every rank's metrics go
to `<run_dir>/metrics.jsonl` (written by rank 0 from an all-gather, one line per rank and step; the
step's global router telemetry on rank 0's line, train/telemetry.py), and to TensorBoard / W&B when
the recipe asks (train/loggers.py).
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from gptoss_cli import outputs
from gptoss_cli.checkpoint.training_format import RUN_KEY, base_fingerprint, read_train_state, require_same_base, run_record
from gptoss_cli.errors import CheckpointError, TrainingError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.recipe.environment import gpu_from_device_name
from gptoss_cli.recipe.flops import model_flops_per_token, peak_tflops, recompute_flops_per_token, throughput
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.resources import keep_freed_memory
from gptoss_cli.model.loss import IGNORE_INDEX, lm_loss_sum
from gptoss_cli.parallel.grads import get_attr_wrapped_model, get_model_config
from gptoss_cli.parallel.state import ParallelState, all_gather, barrier, destroy_parallel, init_parallel
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint
from gptoss_cli.train.data import DataLoaderState, Microbatch, build_source
from gptoss_cli.train.heartbeat import Heartbeat
from gptoss_cli.train.loggers import Loggers, open_loggers
from gptoss_cli.train.optimizer import WarmupCosineLR
from gptoss_cli.train.progress import CheckpointSaved, StepDone, TrainFinished, TrainProgress, TrainStarted
from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig
from gptoss_cli.train.setup import setup_model_and_optimizer
from gptoss_cli.train.telemetry import StepTotals


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
            "target_modules": list(lo.target_modules), "base": lora_base, "base_experts": lo.base_experts}
        return run_record(arch=self.arch, hybrid_layer_pattern=self.hybrid_layer_pattern,
                          params_dtype=self.config.precision.params_dtype, name=self.name, run_dir=self.run_dir,
                          recipe=self.recipe, pretrained=self.config.checkpoint.pretrained,
                          qat=self.config.precision.qat, lora=lora)

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
    # packed documents (a version-2 token file): real tokens / row positions, and the number of rows
    packing: dict[str, Any] | None = None
    model_flops_per_token: float = 0.0  # training FLOPs per token (gptoss_cli/recipe/flops.py)
    tflops_per_gpu: float = 0.0  # model TFLOP/s per GPU over the timed steps (the first step excluded)
    mfu: float | None = None  # tflops_per_gpu / the GPU's dense peak; None when the peak is unknown
    peak_tflops: float | None = None  # the peak used (bf16 or FP8 by precision.fp8_recipe, per system.gpu)
    qat: str = "none"  # precision.qat: "mxfp4" when the experts computed with MXFP4-rounded weights (docs/qat.md)
    notes: list[str] = field(default_factory=list)  # e.g. leftovers of killed runs that were removed


def forward_step(data_iterator: Iterator[Microbatch], model: torch.nn.Module,
                 return_schedule_plan: bool = False) -> tuple[Any, Callable[[Any], tuple[torch.Tensor, torch.Tensor, dict]]]:
    """Megatron's forward_step contract: one microbatch -> (model output, loss_func).

    With `return_schedule_plan` (the overlap schedule asks for it) the output is the model's
    schedule plan for the microbatch instead of its forward; the schedule runs the plan and calls
    loss_func on its output. Either way the schedule decides when the loss is computed."""
    mb = next(data_iterator)
    config = get_model_config(model)
    loss_func = functools.partial(microbatch_loss, mb.labels, config.aux_loss_coeff,
                                  z_coeff=getattr(config, "z_loss_coeff", 0.0))
    if return_schedule_plan:
        return get_attr_wrapped_model(model, "build_schedule_plan")(mb.tokens, **mb.model_inputs()), loss_func
    return model(mb.tokens, **mb.model_inputs()), loss_func


def microbatch_loss(labels: torch.Tensor, aux_coeff: float, output: Any, *,
                    z_coeff: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(summed token cross-entropy + aux and z-loss scaled by the microbatch's tokens, tokens, logs).

    The logs stay on the device: the loss terms, and the model's router table when it has one
    (train/telemetry.py sums them over the step)."""
    lm_sum = lm_loss_sum(output, labels)  # chunked over tokens for HybridOutput (model/loss.py)
    num_tokens = (labels != IGNORE_INDEX).sum()
    loss_sum = lm_sum
    logs: dict[str, Any] = {"lm_loss_sum": lm_sum.detach()}
    # The aux and z-losses are per-microbatch means; weighting them by the microbatch's tokens
    # keeps the global per-token normalisation in finalize_model_grads exact.
    if getattr(output, "aux_loss", None) is not None and aux_coeff > 0:
        loss_sum = loss_sum + aux_coeff * output.aux_loss * num_tokens
        logs["aux_loss"] = output.aux_loss.detach()
    if getattr(output, "z_loss", None) is not None and z_coeff > 0:
        loss_sum = loss_sum + z_coeff * output.z_loss * num_tokens
        logs["z_loss"] = output.z_loss.detach()
    if getattr(output, "router_table", None) is not None:
        logs["router_table"] = output.router_table
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

    def write(self, step: int, common: dict[str, Any], local: list[float],
              rank0: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """`common` goes on every rank's line, `rank0` (the global router telemetry) on rank 0's only.
        Returns the step's records on rank 0 (for the loggers), [] elsewhere."""
        row = torch.tensor(local, dtype=torch.float64, device=self.state.device)
        if self.state.distributed:
            rows = torch.empty(self.state.world_size * len(local), dtype=torch.float64, device=self.state.device)
            all_gather(rows, row, dist.group.WORLD)  # one row per rank of the world, in rank order
            rows = rows.view(self.state.world_size, len(local))
        else:
            rows = row[None]
        if self.state.rank != 0:
            return []
        records = []
        for r, values in enumerate(rows.tolist()):
            local_d = dict(zip(self.FIELDS, values))
            local_loss = local_d["lm_loss_sum"] / max(local_d["num_tokens"], 1)
            records.append({"step": step, "rank": r, **common, "rank_loss": local_loss,
                            "rank_tokens": int(local_d["num_tokens"]), "rank_step_time_s": local_d["step_time_s"],
                            **((rank0 or {}) if r == 0 else {})})
        with outputs.naming(self.path), self.path.open("a") as fh:  # a full disk names the file
            fh.write("".join(json.dumps(record) + "\n" for record in records))
        return records


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


def run_worker(job: TrainJob, progress: TrainProgress | None = None) -> TrainResult:
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
        # Under torchrun a peer that never starts would hold this rank in the rendezvous for 10 minutes.
        state = init_parallel(cfg.parallelism.expert_model_parallel_size, cfg.system.device, cfg.parallelism.backend,
                              join_timeout_s=cfg.system.heartbeat_timeout_s if self_watch else None,
                              cp_size=cfg.parallelism.context_parallel_size)
        if state.device.type == "cpu":
            # The step frees and reallocates the same activations every step: keep them in the
            # heap instead of paying page faults for fresh mappings each time (resources.py).
            keep_freed_memory()
        try:
            # TensorBoard / W&B on rank 0 (train/loggers.py); their packages were checked before launch.
            loggers = open_loggers(cfg.logging, Path(job.run_dir), job.name, job.recipe) if state.rank == 0 else None
            try:
                return _train(job, state, progress, heartbeat, loggers)
            finally:
                if loggers is not None:
                    loggers.close()
        finally:
            if owns_group:
                destroy_parallel()
    finally:
        heartbeat.stop()


def run_peak_tflops(cfg: RecipeConfig, device: torch.device) -> float | None:
    """The dense peak MFU is measured against: system.gpu's (detected on CUDA when auto), at the FP8
    rate when an FP8 recipe is on; None on CPUs and unknown GPUs."""
    gpu = cfg.system.gpu
    if device.type != "cuda":
        return None
    if gpu == "auto":
        gpu = gpu_from_device_name(torch.cuda.get_device_name(device))
    return peak_tflops(gpu, cfg.precision.fp8_recipe != "none")


def _train(job: TrainJob, state: ParallelState, progress: TrainProgress | None, heartbeat: Heartbeat,
           loggers: Loggers | None = None) -> TrainResult:
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
    packing = ({"efficiency": source.efficiency, "rows": source.num_samples, "seq_length": t.seq_length}
               if getattr(source, "documents", False) else None)
    data = DataLoaderState(source, global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                           dp_rank=state.data_parallel_rank, dp_size=state.data_parallel_size, device=state.device,
                           cp_size=state.cp_size, cp_rank=state.cp_rank)

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
        outputs.replace_text(run_dir / "recipe.json", json.dumps(job.recipe, indent=2, default=str) + "\n")
    metrics = MetricsWriter(run_dir, state)
    totals_layout = StepTotals([j for j, _ in model.module.moe_layers()], job.arch.num_local_experts)
    schedule = get_forward_backward_func(setup.config)
    fp8 = setup.config.fp8_gemms  # the FP8 gemms the provider selected: which path runs, what ran
    if fp8 is not None:
        fp8.guard.deferred = True  # NaN/inf checks recorded on the device, read once per step below
    emit = progress if (progress is not None and state.rank == 0) else None
    flops_per_token = model_flops_per_token(job.arch, t.seq_length, job.hybrid_layer_pattern)
    # recompute's repeated forward work: hardware FLOPs, reported apart from the model's
    hardware_flops = flops_per_token + recompute_flops_per_token(
        job.arch, t.seq_length, job.hybrid_layer_pattern, runtime.recompute.layer_pieces(model.module.pattern.layers))
    peak = run_peak_tflops(cfg, state.device)
    step_tokens = t.global_batch_size * t.seq_length  # every token of the step runs through the model
    if emit:
        emit(TrainStarted(start_step=start_step, train_iters=t.train_iters, world_size=state.world_size,
                          ep_size=state.ep_size, cp_size=state.cp_size, resumed_from=resumed_from,
                          fp8=fp8.describe() if fp8 else None, packing=packing, qat=cfg.precision.qat))

    losses: list[float] = []
    norms: list[float] = []
    tokens_total, time_total, timed_steps = 0.0, 0.0, 0
    last_ckpt = None
    for step in range(start_step, t.train_iters):
        heartbeat.progress(step + 1, "step")
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        logs = schedule(forward_step_func=forward_step, data_iterator=heartbeat.beating(data.step_iterator(), step + 1),
                        model=model, num_microbatches=data.num_microbatches, forward_only=False)
        local = totals_layout.vector(logs, state.device)
        totals = local.clone()
        if state.distributed:
            dist.all_reduce(totals, group=state.dp_group)  # one small collective for every step total
        # The step's one host sync; the FP8 NaN/inf flag (fp8/guard.py) rides on it and is checked first.
        read = torch.cat([local, totals, fp8.guard.flag(state.device).view(1) if fp8 else local[:0]]).tolist()
        local_values, values = read[:local.numel()], read[local.numel():2 * local.numel()]
        if fp8 is not None:
            fp8.guard.check(read[-1], step + 1)
        reduced = totals_layout.scalars(values)
        loss = reduced["lm_loss_sum"] / reduced["num_tokens"] if reduced["num_tokens"] else math.nan
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
        tokens = reduced["num_tokens"]
        if step > start_step or t.train_iters - start_step == 1:  # the first step warms up: not in the average
            tokens_total += tokens
            time_total += dt
            timed_steps += 1
        losses.append(loss)
        norms.append(grad_norm)
        done = step + 1
        tflops, mfu = throughput(flops_per_token, step_tokens / dt, state.world_size, peak)
        common = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens / dt,
                  "step_time_s": dt, "consumed_samples": data.consumed_samples,
                  "model_flops_per_token": flops_per_token, "tflops_per_gpu": tflops, "mfu": mfu,
                  "hardware_tflops_per_gpu": tflops * hardware_flops / flops_per_token}
        if cfg.moe.aux_loss_coeff > 0:
            common["aux_loss"] = reduced["aux_loss_sum"] / reduced["num_tokens"]
        if cfg.moe.z_loss_coeff > 0:
            common["z_loss"] = reduced["z_loss_sum"] / reduced["num_tokens"]
        if fp8 is not None:
            common["fp8"] = fp8.summary()
        router = totals_layout.router_record(values)
        records = metrics.write(done, common, [local_values[0], local_values[1], dt], rank0=router)
        if loggers is not None:
            loggers.log(done, records)
        if emit and (done % cfg.logging.log_interval == 0 or done == t.train_iters):
            emit(StepDone(step=done, **common))
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
                emit(CheckpointSaved(step=done, path=str(last_ckpt)))
    heartbeat.progress(t.train_iters, "finishing", watched=False)
    barrier()
    tflops, mfu = throughput(flops_per_token, step_tokens * timed_steps / time_total if time_total else 0.0,
                             state.world_size, peak)
    result = TrainResult(
        steps=len(losses), final_step=max(start_step, t.train_iters), losses=losses, grad_norms=norms,
        tokens_per_s=(tokens_total / time_total) if time_total else 0.0, run_dir=str(run_dir),
        checkpoint=str(last_ckpt) if last_ckpt else None, resumed_from=resumed_from,
        world_size=state.world_size, ep_size=state.ep_size, fp8=fp8.summary() if fp8 else None, packing=packing,
        model_flops_per_token=flops_per_token, tflops_per_gpu=tflops, mfu=mfu if time_total else None, peak_tflops=peak,
        qat=cfg.precision.qat,
    )
    if emit:
        emit(TrainFinished(result))
    return result


__all__ = ["TrainJob", "TrainResult", "run_worker", "forward_step", "MetricsWriter"]
