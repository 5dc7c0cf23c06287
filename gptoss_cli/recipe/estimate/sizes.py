"""Parallel-layout arithmetic of a recipe: world size, data-parallel and expert-data-parallel sizes.

Megatron's definitions (docs/megatron-rules.md, "Token dispatcher and expert data parallel"):
data parallel = world / (TP x PP x CP); expert data parallel = world / (ETP x EP x PP).
"""

from __future__ import annotations

import math

from gptoss_cli.recipe.schema import RecipeConfig


def model_parallel_size(cfg: RecipeConfig) -> int:
    p = cfg.parallelism
    return p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size


def expert_model_parallel_product(cfg: RecipeConfig) -> int:
    p = cfg.parallelism
    return p.expert_tensor_parallel_size * p.expert_model_parallel_size * p.pipeline_model_parallel_size


def resolve_world_size(cfg: RecipeConfig, explicit: int | None = None) -> tuple[int, str]:
    """(world size, where it came from): --world-size, then the recipe, then the smallest that fits."""
    p = cfg.parallelism
    if explicit is not None:
        return explicit, "--world-size"
    if p.world_size is not None:
        return p.world_size, "parallelism.world_size"
    if p.nodes is not None and p.gpus_per_node is not None:
        return p.nodes * p.gpus_per_node, "parallelism.nodes x gpus_per_node"
    if p.data_parallel_size is not None:
        return p.data_parallel_size * model_parallel_size(cfg), "data_parallel_size x TP x PP x CP"
    mp, emp = model_parallel_size(cfg), expert_model_parallel_product(cfg)
    if mp > 0 and emp > 0:
        return math.lcm(mp, emp), "smallest world for the model-parallel sizes"
    return 1, "default"


def data_parallel_size(cfg: RecipeConfig, world: int) -> int | None:
    """world / (TP x PP x CP), or None when that does not divide."""
    mp = model_parallel_size(cfg)
    return world // mp if mp > 0 and world > 0 and world % mp == 0 else None


def expert_data_parallel_size(cfg: RecipeConfig, world: int) -> int | None:
    """world / (ETP x EP x PP), or None when that does not divide."""
    emp = expert_model_parallel_product(cfg)
    return world // emp if emp > 0 and world > 0 and world % emp == 0 else None



__all__ = ["model_parallel_size", "expert_model_parallel_product", "resolve_world_size", "data_parallel_size",
           "expert_data_parallel_size"]
