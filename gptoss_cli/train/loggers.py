"""TensorBoard and Weights & Biases logging of the metrics.jsonl records, on rank 0, as optional extras.

Both backends get the same scalars under the same tags (`scalar_tags`, docs/router-telemetry.md):
a record's numeric fields under `train/<name>` (nested maps and lists flattened with `/`, so the
expert load of layer 1, expert 3 is `train/expert_load/1/3`), a rank's own fields (`rank_loss`,
`rank_tokens`, `rank_step_time_s`) under `rank<r>/<name without rank_>`. Strings and booleans
are not scalars and are left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptoss_cli.errors import require_extra
from gptoss_cli.recipe.schema import LoggingConfig

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
_SKIP = ("step", "rank")


def _flatten(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        out[prefix] = float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}", v, out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(f"{prefix}/{i}", v, out)


def scalar_tags(record: dict[str, Any]) -> dict[str, float]:
    """Every scalar of one metrics.jsonl record, by tag (see the module docstring)."""
    out: dict[str, float] = {}
    rank = record.get("rank", 0)
    for key, value in record.items():
        if key in _SKIP:
            continue
        if key.startswith("rank_"):
            _flatten(f"rank{rank}/{key[len('rank_'):]}", value, out)
        else:
            _flatten(f"train/{key}", value, out)
    return out


def check_backends(logging: LoggingConfig) -> None:
    """Before launch: the packages of the backends the recipe turns on are installed (one-line error)."""
    if logging.tensorboard:
        require_extra("torch.utils.tensorboard", "TensorBoard logging", "tensorboard", "logging.tensorboard=true",
                      package="tensorboard")
    if logging.wandb_project:
        require_extra("wandb", "Weights & Biases logging", "wandb", f"logging.wandb_project={logging.wandb_project}")


class Loggers:
    """The open backends; `log(step, records)` sends every scalar of the step's records."""

    def __init__(self, tensorboard: Any = None, wandb_run: Any = None):
        self.tensorboard = tensorboard
        self.wandb_run = wandb_run

    def log(self, step: int, records: list[dict[str, Any]]) -> None:
        scalars: dict[str, float] = {}
        for record in records:
            scalars.update(scalar_tags(record))
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, step)
            self.tensorboard.flush()  # a killed run keeps what it logged
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def open_loggers(logging: LoggingConfig, run_dir: Path, name: str, recipe: dict[str, Any]) -> Loggers | None:
    """The backends the recipe turns on, writing under `run_dir`; None when there are none."""
    if not (logging.tensorboard or logging.wandb_project):
        return None
    check_backends(logging)
    tensorboard = wandb_run = None
    if logging.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        tensorboard = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))
    if logging.wandb_project:
        import wandb

        (Path(run_dir) / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        wandb_run = wandb.init(project=logging.wandb_project, name=name, dir=str(Path(run_dir) / WANDB_DIR),
                               mode=logging.wandb_mode, config=recipe, settings=wandb.Settings(silent=True))
    return Loggers(tensorboard, wandb_run)


__all__ = ["scalar_tags", "check_backends", "open_loggers", "Loggers", "TENSORBOARD_DIR", "WANDB_DIR"]
