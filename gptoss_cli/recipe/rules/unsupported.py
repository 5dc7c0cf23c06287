"""Options `gptoss train` does not implement yet, as one table (rules `unsupported.*`).

Each row names the option, when the recipe is inside what gptoss implements, the fields to show,
and the fix. They are errors for the `gptoss` target (what train checks) and notes for the
`megatron` target. Widen `IMPLEMENTED` (rules/core.py) or a row's test when a feature lands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gptoss_cli.recipe.rules.core import (
    IMPLEMENTED, UNSUPPORTED, Context, Finding, Rule, error, field_value, register_rule,
)
from gptoss_cli.recipe.schema import RecipeConfig


@dataclass(frozen=True)
class Unsupported:
    id: str  # rule id after "unsupported."
    description: str  # the rule list's one line
    fields: tuple[str, ...]  # shown with their values
    implemented: Callable[[RecipeConfig, Context], bool]  # True: nothing to report
    what: Callable[[RecipeConfig], str]  # "<what> is not implemented in gptoss yet"
    fix: str


def _one_of_implemented(field: str, key: str) -> Callable[[RecipeConfig, Context], bool]:
    """A row's `implemented` check for a field whose implemented values are `IMPLEMENTED[key]` (read when
    the rule runs, so widening the set is all a new feature needs)."""
    return lambda c, x: field_value(c, field) in IMPLEMENTED[key]


TABLE: tuple[Unsupported, ...] = (
    Unsupported(
        "tensor_parallel", "tensor parallelism / sequence parallelism",
        ("parallelism.tensor_model_parallel_size", "parallelism.sequence_parallel"),
        lambda c, x: c.parallelism.tensor_model_parallel_size == 1 and not c.parallelism.sequence_parallel,
        lambda c: "tensor/sequence parallelism",
        "set parallelism.tensor_model_parallel_size=1 parallelism.sequence_parallel=false"),
    Unsupported(
        # Under pipelining the overlap runs in DualPipeV's OVERLAP_F_B actions (gptoss_cli/schedule/pipeline/plan_stage.py).
        "pipeline_ep_overlap", "EP all-to-all overlap under pipeline parallelism with a schedule other than dualpipev",
        ("parallelism.pipeline_model_parallel_size", "parallelism.pipeline_schedule",
         "overlap.overlap_moe_expert_parallel_comm"),
        lambda c, x: (c.parallelism.pipeline_model_parallel_size == 1 or not c.overlap.overlap_moe_expert_parallel_comm
                      or c.parallelism.pipeline_schedule == "dualpipev"),
        lambda c: f"EP all-to-all overlap under pipeline parallelism with {c.parallelism.pipeline_schedule} "
                  "(only DualPipeV's overlapped forward and backward)",
        "set parallelism.pipeline_schedule=dualpipev (VPP=2), or overlap.overlap_moe_expert_parallel_comm=false "
        "overlap.delay_wgrad_compute=false"),
    Unsupported(
        "expert_tensor_parallel", "expert tensor parallelism", ("parallelism.expert_tensor_parallel_size",),
        lambda c, x: c.parallelism.expert_tensor_parallel_size == 1,
        lambda c: "expert tensor parallelism", "set parallelism.expert_tensor_parallel_size=1"),
    Unsupported(
        "megatron_fsdp", "Megatron FSDP", ("parallelism.use_megatron_fsdp",),
        lambda c, x: not c.parallelism.use_megatron_fsdp,
        lambda c: "Megatron FSDP", "set parallelism.use_megatron_fsdp=false"),
    Unsupported(
        "token_dispatcher", "token dispatchers other than alltoall", ("moe.token_dispatcher_type",),
        _one_of_implemented("moe.token_dispatcher_type", "token_dispatchers"),
        lambda c: f"the {c.moe.token_dispatcher_type!r} token dispatcher", "set moe.token_dispatcher_type=alltoall"),
    Unsupported(
        "token_dropping", "capacity factor (token dropping); gptoss routes dropless", ("moe.capacity_factor",),
        lambda c, x: c.moe.capacity_factor is None,
        lambda c: "token dropping (capacity_factor)", "set moe.capacity_factor=null (dropless)"),
    Unsupported(
        "router_dtype", "a router dtype other than the params dtype", ("moe.router_dtype",),
        lambda c, x: c.moe.router_dtype is None,
        lambda c: f"computing the router in {c.moe.router_dtype}",
        "set moe.router_dtype=null (the router runs in the params dtype)"),
    Unsupported(
        "fp16", "fp16 parameters (they need dynamic loss scaling)", ("precision.params_dtype",),
        lambda c, x: c.precision.params_dtype != "fp16",
        lambda c: "fp16 training (dynamic loss scaling)", "set precision.params_dtype=bf16"),
    Unsupported(
        "fp8", "FP8 recipes gptoss train does not implement", ("precision.fp8_recipe",),
        _one_of_implemented("precision.fp8_recipe", "fp8_recipes"),
        lambda c: f"FP8 recipe {c.precision.fp8_recipe!r}", "set precision.fp8_recipe=none"),
    Unsupported(
        "cuda_graphs", "CUDA graphs and the paged stash", ("cuda_graphs.cuda_graph_impl", "cuda_graphs.paged_stash"),
        lambda c, x: c.cuda_graphs.cuda_graph_impl == "none" and not c.cuda_graphs.paged_stash,
        lambda c: "CUDA graph capture", "set cuda_graphs.cuda_graph_impl=none cuda_graphs.paged_stash=false"),
    Unsupported(
        # overlap_grad_reduce is implemented (gptoss_cli/parallel/grads.py); the gather after the
        # optimizer step still runs before the next forward.
        "param_gather_overlap", "overlap_param_gather (overlapping the parameter all-gather with forward)",
        ("overlap.overlap_param_gather",),
        lambda c, x: not c.overlap.overlap_param_gather,
        lambda c: "overlapping the distributed optimizer's parameter all-gather with forward",
        "set overlap.overlap_param_gather=false"),
    Unsupported(
        "checkpoint_format", "checkpoint formats other than gptoss's own", ("checkpoint.format",),
        _one_of_implemented("checkpoint.format", "checkpoint_formats"),
        lambda c: f"the {c.checkpoint.format!r} checkpoint format", "set checkpoint.format=gptoss"),
)


def _check(row: Unsupported) -> Callable[[RecipeConfig, Context], list[Finding]]:
    def check(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
        if row.implemented(cfg, ctx):
            return []
        return [error({f: field_value(cfg, f) for f in row.fields},
                      f"{row.what(cfg)} is not implemented in gptoss yet", row.fix)]

    check.__name__ = f"unsupported_{row.id}"
    return check


for _row in TABLE:
    register_rule(Rule(f"unsupported.{_row.id}", UNSUPPORTED, _row.description, _check(_row), fix=_row.fix))
