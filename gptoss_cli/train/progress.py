"""What a training run reports: typed progress events, the callback type that receives them, and the result.

Rank 0's training loop calls `progress(event)` (gptoss_cli/train/loop.py) with one of the events
below; the CLI renders them (gptoss_cli/cli/train.py, `TrainProgressBar`). The callback object is
pickled into the spawned workers (gptoss_cli/run/launch.py) and called there; the events are
plain frozen dataclasses of plain data, so they pickle too. `TrainResult` is what the run returns
(and `TrainFinished` carries).

A step's own numbers (loss, lr, throughput...) are `StepDone`'s fields; the objective's (GRPO's
reward and mismatch, a router loss, whatever an objective reports) ride in its `objective_metrics`
by name, and `MetricDisplay` is how an objective asks the console line and `gptoss report` to show
one of them (`TrainingObjective.shown_metrics`, train/objective.py): neither knows any by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union


@dataclass(frozen=True)
class MetricDisplay:
    """How `gptoss train`'s console line and `gptoss report` show one of an objective's metrics."""

    name: str  # the metrics.jsonl field, e.g. "reward_mean"
    label: str  # report's name for its curve (axis and title), e.g. "mean reward"
    console: str  # the word before its value on the console line, e.g. "reward"
    format: str = ".4g"  # the value's format spec on the console line


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
    model_flops_per_token: float = 0.0  # training FLOPs per token (gptoss_cli/recipe/estimate/flops.py)
    tflops_per_gpu: float = 0.0  # model TFLOP/s per GPU over the timed steps (the first step excluded)
    mfu: float | None = None  # tflops_per_gpu / the GPU's dense peak; None when the peak is unknown
    peak_tflops: float | None = None  # the peak used (bf16 or FP8 by precision.fp8_recipe, per system.gpu)
    qat: str = "none"  # precision.qat: "mxfp4" when the experts computed with MXFP4-rounded weights (docs/qat.md)
    notes: list[str] = field(default_factory=list)  # e.g. leftovers of killed runs that were removed
    # the objective's shown metrics (GRPO's reward...) over this run: {"name", "label", "format", "first", "last"}
    shown: list[dict[str, Any]] = field(default_factory=list)


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
    shown_metrics: tuple[MetricDisplay, ...] = ()  # the objective's, for the step lines (TrainingObjective)
    notes: tuple[str, ...] = ()  # what the Trainer says at the start (GRPO: the rollout engine, its log, its start-up)


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
    fp8: dict[str, Any] | None = None  # `Fp8Gemms.summary()` when FP8 runs
    val_loss: float | None = None  # the held-out loss, at the steps validation ran (validation.*)
    # The line's other numbers by their metrics.jsonl names: the objective's and its Trainer's (aux_loss,
    # GRPO's reward_mean...), and a validation's beyond val_loss; `TrainStarted.shown_metrics` says
    # which the step lines show.
    objective_metrics: dict[str, float] = field(default_factory=dict)


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

__all__ = ["MetricDisplay", "TrainResult", "TrainStarted", "StepDone", "CheckpointSaved", "RunWarning", "TrainFinished", "TrainEvent",
           "TrainProgress"]
