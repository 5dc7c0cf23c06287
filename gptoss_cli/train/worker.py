"""A rank's entry point: `run_worker(job, progress)` joins the process group (torchrun's
environment, or a single process), starts the heartbeat and the loggers, and runs the `Trainer`
(train/loop.py) of the recipe's `objective.kind` with its training objective.

This module is the one place an objective kind is switched on (`build_objective`, `trainer_class`):
it sits above both train/loop.py and gptoss_cli/rl/, which builds on the loop, so neither imports
the other's chooser. A new objective adds its branch here (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gptoss_cli.parallel.state import destroy_parallel, init_parallel
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.train.heartbeat import Heartbeat
from gptoss_cli.train.job import TrainJob
from gptoss_cli.train.loggers import open_loggers
from gptoss_cli.train.loop import Trainer
from gptoss_cli.train.objective import CrossEntropyObjective, TrainingObjective
from gptoss_cli.train.progress import TrainProgress, TrainResult


def build_objective(config: Any) -> TrainingObjective:
    """The objective a recipe (`RecipeConfig`) trains with (`objective.kind`): next-token cross-entropy, or
    GRPO (gptoss_cli/rl/objective.py) on the rollouts its Trainer samples; a new objective adds its
    recipe switch here."""
    if config.objective.kind == "grpo":
        from gptoss_cli.rl.objective import GRPOObjective  # noqa: PLC0415 - only GRPO recipes load rl/

        rl = config.rl
        return GRPOObjective(loss_type=rl.loss, clip_low=rl.clip_low, clip_high=rl.clip_high, kl_coeff=rl.kl_coeff,
                             kl_unbiased=rl.kl_unbiased, temperature=rl.temperature, max_new_tokens=rl.max_new_tokens,
                             is_cap=None if rl.rollout.engine == "gptoss" else rl.rollout.is_cap,
                             aux_loss_coeff=config.moe.aux_loss_coeff, z_loss_coeff=config.moe.z_loss_coeff)
    return CrossEntropyObjective(config.moe.aux_loss_coeff, config.moe.z_loss_coeff)


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
                              cp_size=cfg.parallelism.context_parallel_size,
                              pp_size=cfg.parallelism.pipeline_model_parallel_size)
        # glibc's allocator stays at its defaults here: keeping freed memory in the heap (resources.py)
        # fragments it under a training step's mix of sizes, and a worker grew without bound; on the CPU
        # the Trainer hands the heap's free pages back after every step (resources.release_freed_heap).
        try:
            # TensorBoard / W&B on rank 0 (train/loggers.py); their packages were checked before launch.
            loggers = open_loggers(cfg.logging, Path(job.run_dir), job.name, job.recipe) if state.rank == 0 else None
            try:
                if job.objective is None:
                    job = dataclasses.replace(job, objective=build_objective(cfg))
                trainer = trainer_class(cfg)(job, state, progress=progress, heartbeat=heartbeat, loggers=loggers)
                try:
                    trainer.resume()
                    return trainer.train()
                finally:
                    trainer.close()
            finally:
                if loggers is not None:
                    loggers.close()
        finally:
            if owns_group:
                destroy_parallel()
    finally:
        heartbeat.stop()


def trainer_class(cfg: RecipeConfig) -> type[Trainer]:
    """The Trainer of the recipe's objective: GRPO's samples its own data (gptoss_cli/rl/trainer.py)."""
    if cfg.objective.kind == "grpo":
        from gptoss_cli.rl.trainer import RLTrainer  # noqa: PLC0415 - only GRPO recipes load rl/

        return RLTrainer
    return Trainer


__all__ = ["run_worker", "build_objective", "trainer_class"]
