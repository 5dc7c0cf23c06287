"""What a training run reports: typed progress events, the callback type that receives them, and the result.

Rank 0's training loop calls `progress(event)` (gptoss_cli/train/loop.py) with one of the events
below; the CLI renders them (gptoss_cli/cli/train.py, `TrainProgressBar`). The callback object is
pickled into the spawned workers (gptoss_cli/run/launch.py) and called there; the events are
plain frozen dataclasses of plain data, so they pickle too. `TrainResult` is what the run returns
(and `TrainFinished` carries).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union


@dataclass
class TrainResult:
    """What a run did: rank 0's view, returned by `run_worker` and `gptoss_cli.run.launch.train`."""

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


@dataclass(frozen=True)
class TrainStarted:
    """Setup is done (and a checkpoint resumed, if any); the first step follows."""

    start_step: int  # steps done before this run (a resumed checkpoint's), 0 for a new run
    train_iters: int
    world_size: int
    ep_size: int
    cp_size: int = 1
    pp_size: int = 1
    pipeline_schedule: str | None = None  # parallelism.pipeline_schedule with PP > 1
    resumed_from: str | None = None  # the checkpoint folder resumed from
    fp8: str | None = None  # `Fp8Gemms.describe()`: recipe, format, path and kernel, device
    packing: dict[str, Any] | None = None  # {"efficiency", "rows", "seq_length"} for packed documents
    qat: str = "none"  # precision.qat


@dataclass(frozen=True)
class StepDone:
    """A logged step (every `logging.log_interval` steps and the last): the numbers of its metrics.jsonl line."""

    step: int  # steps done, counting those before a resume
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    step_time_s: float
    consumed_samples: int
    model_flops_per_token: float
    tflops_per_gpu: float
    mfu: float | None  # None where the GPU's peak is unknown (a CPU)
    hardware_tflops_per_gpu: float  # with recompute's repeated forward work
    aux_loss: float | None = None  # when moe.aux_loss_coeff > 0
    z_loss: float | None = None  # when moe.z_loss_coeff > 0
    fp8: dict[str, Any] | None = None  # `Fp8Gemms.summary()` when FP8 runs
    val_loss: float | None = None  # the held-out loss, at the steps validation ran (validation.*)
    reward_mean: float | None = None  # GRPO (objective.kind=grpo): the rollout's mean reward
    mismatch_kl: float | None = None  # GRPO: engine vs trainer log-probabilities (gptoss_cli/rl/objective.py)


@dataclass(frozen=True)
class CheckpointSaved:
    step: int
    path: str  # the checkpoint's folder
    removed: list[str] = field(default_factory=list)  # older checkpoints retention deleted (checkpoint.keep_last)


@dataclass(frozen=True)
class RunWarning:
    """Something the run noticed and carries on with (a reward that failed, an engine that drifts): one line."""

    step: int
    message: str


@dataclass(frozen=True)
class TrainFinished:
    result: TrainResult


TrainEvent = Union[TrainStarted, StepDone, CheckpointSaved, RunWarning, TrainFinished]
TrainProgress = Callable[[TrainEvent], None]

__all__ = ["TrainResult", "TrainStarted", "StepDone", "CheckpointSaved", "RunWarning", "TrainFinished", "TrainEvent",
           "TrainProgress"]
