"""Helpers for the recipe tests: run one rule on a recipe with overrides, or call it with its context."""

from __future__ import annotations

from typing import Any, Sequence

from gptoss_cli.recipe.load import load_recipe
from gptoss_cli.recipe.rules import RULES, Context, Finding
from gptoss_cli.recipe.estimate.sizes import resolve_world_size
from gptoss_cli.recipe.validate import validate_recipe

OVERLAP = ["overlap.overlap_moe_expert_parallel_comm=true"]


def run_rule(rule_id: str, overrides: Sequence[str] = (), recipe: str = "tiny_cpu_ep2", **kwargs: Any) -> list[Finding]:
    """Findings of one rule on a recipe (default tiny_cpu_ep2) with overrides."""
    loaded = load_recipe(recipe, list(overrides))
    return validate_recipe(loaded, rules=[RULES[rule_id]], **kwargs).findings


def make_ctx(recipe: str = "tiny_cpu_ep2", overrides: Sequence[str] = (), **kwargs: Any):
    """(cfg, Context) for calling a rule function directly."""
    loaded = load_recipe(recipe, list(overrides))
    world, source = resolve_world_size(loaded.config, kwargs.pop("world_size", None))
    ctx = Context(arch=loaded.arch, pattern=loaded.pattern, world_size=world, world_size_source=source, **kwargs)
    return loaded.config, ctx
