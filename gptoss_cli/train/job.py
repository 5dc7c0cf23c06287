"""What a training worker is handed: `TrainJob`, the recipe's typed config and what was resolved from it.

Resolved in the launching process (gptoss_cli/run/launch.py) and pickled into spawned workers: plain data,
plus the training objective when a caller brings its own (train/objective.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptoss_cli.checkpoint.formats.training.record import run_record
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.pattern import HybridPattern
from gptoss_cli.recipe.load import Recipe
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.train.objective import TrainingObjective


@dataclass
class TrainJob:
    """A resolved training run: the recipe's typed config and what was resolved from it.

    `config` is the one source of every setting and default (gptoss_cli/recipe/schema.py); the
    worker reads its sections directly. Plain, picklable data: it travels to spawned workers."""

    config: RecipeConfig
    arch: GptOssArch
    pattern: HybridPattern  # the recipe's layer pattern, parsed once when the recipe was loaded
    name: str
    run_dir: str
    recipe: dict[str, Any] = field(default_factory=dict)  # the resolved recipe as plain data, for the run dir
    heartbeat_dir: str | None = None  # set by the local launcher, whose watchdog reads the beats
    # What each step computes; None = the recipe's (its `objective.kind`'s row in gptoss_cli/run/objectives.py).
    objective: TrainingObjective | None = None

    def run_record(self, lora_base: dict[str, Any] | None = None) -> dict[str, Any]:
        """What every checkpoint of this run records about it (gptoss_cli/checkpoint/formats/training/record.py);
        a LoRA run adds its settings and `lora_base`, the fingerprint of its frozen base."""
        lo = self.config.lora
        lora = None if lo.rank == 0 else {
            "rank": lo.rank, "alpha": float(lo.alpha), "dropout": float(lo.dropout),
            "target_modules": list(lo.target_modules), "base": lora_base, "base_experts": lo.base_experts}
        return run_record(arch=self.arch, hybrid_layer_pattern=self.pattern.text,
                          params_dtype=self.config.precision.params_dtype, name=self.name, run_dir=self.run_dir,
                          recipe=self.recipe, pretrained=self.config.checkpoint.pretrained,
                          qat=self.config.precision.qat, lora=lora)

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> TrainJob:
        """From a loaded recipe."""
        cfg = recipe.config
        name = cfg.name or (recipe.path.stem if recipe.path else "run")
        return cls(config=cfg, arch=recipe.arch, pattern=recipe.pattern, name=name,
                   run_dir=str(Path(cfg.logging.run_dir or Path("runs") / name)), recipe=recipe.to_dict())


__all__ = ["TrainJob"]
