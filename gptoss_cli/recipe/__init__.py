"""Recipes: the structured schema, loading with overrides, and the capability/parallelism rule registry.

Entry points (what validate-config and train call):
    recipe = load_recipe("tiny_cpu_ep2", ["training.train_iters=5"])   # ConfigError on bad input
    report = validate_recipe(recipe, world_size=2)                       # ValidationReport
    preflight(recipe, world_size=2)                                      # raises ValidationFailed
"""

from gptoss_cli.recipe.load import Recipe, available_recipes, find_recipe, load_recipe
from gptoss_cli.recipe.rules import Finding, list_rules
from gptoss_cli.recipe.schema import RecipeConfig, describe_schema
from gptoss_cli.recipe.validate import TARGETS, ValidationReport, load_and_validate, preflight, validate_recipe

__all__ = [
    "Recipe", "RecipeConfig", "Finding", "ValidationReport", "TARGETS", "available_recipes", "find_recipe",
    "load_recipe", "validate_recipe", "load_and_validate", "preflight", "list_rules", "describe_schema",
]
