"""A rank's entry point: `run_worker(job, progress)` joins the process group (torchrun's
environment, or a single process), starts the heartbeat and the loggers, and runs the `Trainer`
(train/loop.py) of the recipe's `objective.kind` with its training objective, both from the one
table in run/objectives.py.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import torch.distributed as dist

from gptoss_cli.parallel.state import destroy_parallel, init_parallel
from gptoss_cli.run.objectives import objective_row
from gptoss_cli.train.heartbeat import Heartbeat
from gptoss_cli.train.job import TrainJob
from gptoss_cli.train.loggers import open_loggers
from gptoss_cli.train.progress import TrainProgress, TrainResult


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
        # the Trainer hands the heap's free pages back once it has grown (resources.HeapRelease).
        try:
            # TensorBoard / W&B on rank 0 (train/loggers.py); their packages were checked before launch.
            loggers = open_loggers(cfg.logging, Path(job.run_dir), job.name, job.recipe) if state.rank == 0 else None
            try:
                row = objective_row(cfg)  # a TrainJob may bring its own objective; the row's Trainer runs it
                if job.objective is None:
                    job = dataclasses.replace(job, objective=row.build(cfg))
                trainer = row.trainer(job, state, progress=progress, heartbeat=heartbeat, loggers=loggers)
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


__all__ = ["run_worker"]
