"""The objective table: the training objective and the Trainer each `objective.kind` of a recipe gets.

`OBJECTIVES` is the one place an objective kind is switched on. A row is the objective's builder
(its class's `from_recipe`, which reads the recipe's section for it) and the Trainer that runs it:
the loop's own (train/loop.py) when the objective trains on the data section's token files, a
subclass when it brings its own data (GRPO's samples rollouts, rl/trainer.py). This module sits
above train/ and rl/: rl/ builds on the loop, and train/ never imports rl/ (tests/test_layering.py).

A new objective is one class in its own package (a `TrainingObjective`, train/objective.py) and one
row here; besides those, its recipe section and its kind in recipe/schema.py's `OBJECTIVES`, and its
rules in recipe/rules/, are what every recipe setting needs (docs/architecture.md, "Where a new
training objective goes"); tests/train/test_objective.py checks that the table and the schema's
kinds agree, and runs an objective of its own added as a row.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from gptoss_cli.distill.trainer import distill_objective, distill_trainer
from gptoss_cli.errors import ConfigError
from gptoss_cli.preference.objective import DPOObjective
from gptoss_cli.preference.trainer import PreferenceTrainer
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.rl.objective import GRPOObjective
from gptoss_cli.rl.trainer import RLTrainer
from gptoss_cli.train.loop import Trainer
from gptoss_cli.train.objective import CrossEntropyObjective, TrainingObjective


class ObjectiveRow(NamedTuple):
    """One objective kind: what builds its objective from a recipe, and the Trainer that runs it."""

    build: Callable[[RecipeConfig], TrainingObjective]  # the objective class's `from_recipe`
    # A Trainer class, called as `trainer(job, state, progress=, heartbeat=, loggers=)`; a kind whose
    # Trainer depends on its section may give a function of those that returns one.
    trainer: Callable[..., Trainer]


OBJECTIVES: dict[str, ObjectiveRow] = {
    "cross_entropy": ObjectiveRow(CrossEntropyObjective.from_recipe, Trainer),
    "grpo": ObjectiveRow(GRPOObjective.from_recipe, RLTrainer),
    "dpo": ObjectiveRow(DPOObjective.from_recipe, PreferenceTrainer),
    # offline (the loop's Trainer) or on-policy (GRPO's) as distill.on_policy says: gptoss_cli/distill/trainer.py
    "distill": ObjectiveRow(distill_objective, distill_trainer),
}


def objective_row(config: RecipeConfig) -> ObjectiveRow:
    """The row of the recipe's `objective.kind` (a kind without one is one line naming the field)."""
    kind = config.objective.kind
    row = OBJECTIVES.get(kind)
    if row is None:
        raise ConfigError(f"objective.kind={kind!r}: no such training objective",
                          hint=f"one of: {', '.join(OBJECTIVES)}")
    return row


def build_objective(config: RecipeConfig) -> TrainingObjective:
    """The objective the recipe trains with (its row's builder)."""
    return objective_row(config).build(config)


__all__ = ["OBJECTIVES", "ObjectiveRow", "objective_row", "build_objective"]
