"""EP all-to-all overlap and delayed wgrad: Megatron's requirements, the model's capability and the CUDA-graph policy.

The single-check requirements are one table (`TABLE`, one row per rule `overlap.<id>`, the way
rules/unsupported.py lists its options); rules with more than one check are functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from gptoss_cli.model.pattern import schedule_plan_support
from gptoss_cli.recipe.rules.core import (
    SEMANTIC, Context, Finding, Rule, error, register_rule, rule, short_pattern, version_tuple,
)
from gptoss_cli.recipe.schema import RecipeConfig


# --- EP all-to-all overlap and delayed wgrad (docs/megatron-rules.md) --------------------------
def _overlap_on(cfg: RecipeConfig) -> bool:
    return bool(cfg.overlap.overlap_moe_expert_parallel_comm)


_OVERLAP_FIELD = {"overlap.overlap_moe_expert_parallel_comm": True}
_TURN_OFF = "turn overlap off: overlap.overlap_moe_expert_parallel_comm=false overlap.delay_wgrad_compute=false"
_OVERLAP_OFF = f"or {_TURN_OFF}"


@dataclass(frozen=True)
class Requirement:
    """One single-check requirement of overlap (rule `overlap.<id>`), checked only with overlap on."""

    id: str  # rule id after "overlap."
    description: str  # the rule list's one line
    fix: str
    met: Callable[[RecipeConfig, Context], bool]  # True: nothing to report
    fields: Callable[[RecipeConfig, Context], dict[str, Any]]  # shown after overlap_moe_expert_parallel_comm
    message: Callable[[RecipeConfig, Context], str]
    hint: str | None = None  # None: the fix


TABLE: tuple[Requirement, ...] = (
    Requirement(
        "requires_expert_parallel", "overlap_moe_expert_parallel_comm needs EP > 1",
        f"set parallelism.expert_model_parallel_size >= 2, {_OVERLAP_OFF}",
        lambda c, x: c.parallelism.expert_model_parallel_size > 1,
        lambda c, x: {"parallelism.expert_model_parallel_size": c.parallelism.expert_model_parallel_size},
        lambda c, x: "EP all-to-all overlap needs expert parallelism, but EP=1 (there is no all-to-all to hide)"),
    Requirement(
        "requires_multiple_experts", "overlap_moe_expert_parallel_comm needs more than one expert", _TURN_OFF,
        lambda c, x: x.arch.num_local_experts > 1,
        lambda c, x: {"num_local_experts": x.arch.num_local_experts},
        lambda c, x: "EP overlap needs more than one expert"),
    Requirement(
        "dispatcher", "overlap_moe_expert_parallel_comm needs the alltoall or flex dispatcher",
        f"set moe.token_dispatcher_type=alltoall, {_OVERLAP_OFF}",
        lambda c, x: c.moe.token_dispatcher_type in ("alltoall", "flex"),
        lambda c, x: {"moe.token_dispatcher_type": c.moe.token_dispatcher_type},
        lambda c, x: f"EP overlap works with the alltoall or flex dispatcher, not {c.moe.token_dispatcher_type!r}"),
    Requirement(
        "precision", "overlap_moe_expert_parallel_comm needs bf16 or fp16 parameters",
        f"set precision.params_dtype=bf16, {_OVERLAP_OFF}",
        lambda c, x: c.precision.params_dtype in ("bf16", "fp16"),
        lambda c, x: {"precision.params_dtype": c.precision.params_dtype},
        lambda c, x: f"EP overlap needs bf16 or fp16, but params_dtype={c.precision.params_dtype}"),
    Requirement(
        "shared_expert_overlap", "overlap_moe_expert_parallel_comm excludes shared-expert overlap",
        f"set moe.shared_expert_overlap=false, {_OVERLAP_OFF}",
        lambda c, x: not c.moe.shared_expert_overlap,
        lambda c, x: {"moe.shared_expert_overlap": True},
        lambda c, x: "EP overlap and shared-expert overlap cannot both be on"),
    Requirement(
        "mtp_num_layers", "overlap_moe_expert_parallel_comm needs mtp_num_layers in (null, 0, 1)",
        f"set model.mtp_num_layers=0, {_OVERLAP_OFF}",
        lambda c, x: c.model.mtp_num_layers in (None, 0, 1),
        lambda c, x: {"model.mtp_num_layers": c.model.mtp_num_layers},
        lambda c, x: f"EP overlap supports at most one MTP layer, got mtp_num_layers={c.model.mtp_num_layers}"),
    Requirement(
        "pipeline_requires_virtual", "overlap_moe_expert_parallel_comm with PP > 1 needs virtual pipeline",
        f"set parallelism.virtual_pipeline_model_parallel_size >= 2, or PP=1, {_OVERLAP_OFF}",
        lambda c, x: (c.parallelism.pipeline_model_parallel_size == 1
                      or bool(c.parallelism.virtual_pipeline_model_parallel_size)),
        lambda c, x: {"parallelism.pipeline_model_parallel_size": c.parallelism.pipeline_model_parallel_size,
                      "parallelism.virtual_pipeline_model_parallel_size": None},
        lambda c, x: "EP overlap with pipeline parallelism needs the interleaved (virtual) pipeline schedule"),
    Requirement(
        "torch_version", "overlap_moe_expert_parallel_comm needs torch >= 2.6", f"torch 2.6 or newer, {_OVERLAP_OFF}",
        lambda c, x: not x.torch_version or version_tuple(x.torch_version) >= (2, 6),
        lambda c, x: {"torch": x.torch_version},
        lambda c, x: f"EP overlap needs torch >= 2.6, this environment has {x.torch_version}",
        hint=f"upgrade torch, {_OVERLAP_OFF}"),
)


def _check(row: Requirement) -> Callable[[RecipeConfig, Context], list[Finding]]:
    def check(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
        if not _overlap_on(cfg) or row.met(cfg, ctx):
            return []
        return [error({**_OVERLAP_FIELD, **row.fields(cfg, ctx)}, row.message(cfg, ctx), row.hint)]

    check.__name__ = f"overlap_{row.id}"
    return check


def _register(rows: tuple[Requirement, ...]) -> None:
    for row in rows:
        register_rule(Rule(f"overlap.{row.id}", SEMANTIC, row.description, _check(row), fix=row.fix))


# Registration order is the order the rules run and docs/rules.md lists them: the first four rows,
# then recompute (two checks with their own fields and fixes, so a function of its own), then the rest.
_register(TABLE[:4])


@rule("overlap.recompute", "overlap_moe_expert_parallel_comm forbids full recompute and recompute of 'moe'",
      fix=f"recompute.recompute_granularity=none (or selective without 'moe'), {_OVERLAP_OFF}")
def overlap_recompute(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    r = cfg.recompute
    if not _overlap_on(cfg):
        return []
    if r.recompute_granularity == "full":
        return [error({**_OVERLAP_FIELD, "recompute.recompute_granularity": "full"},
                      "EP overlap cannot be combined with full activation recompute",
                      f"set recompute.recompute_granularity=selective (without 'moe') or none, {_OVERLAP_OFF}")]
    if r.recompute_granularity == "selective" and "moe" in r.recompute_modules:
        return [error({**_OVERLAP_FIELD, "recompute.recompute_modules": list(r.recompute_modules)},
                      "EP overlap cannot recompute the 'moe' module",
                      f"remove 'moe' from recompute.recompute_modules, {_OVERLAP_OFF}")]
    return []


_register(TABLE[4:])


@rule("overlap.schedule_plan",
      "overlap_moe_expert_parallel_comm needs a model class that can build a schedule plan for the pattern",
      fix=f"a pattern the model can schedule ('*E' per block as convert writes, grouped '[*E]', '-' layers),"
          f" {_OVERLAP_OFF}")
def schedule_plan_capability(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not _overlap_on(cfg):
        return []
    ok, reason = schedule_plan_support(ctx.pattern)
    if ok:
        return []
    fields = {**_OVERLAP_FIELD, "model.hybrid_layer_pattern": short_pattern(ctx.pattern.text)}
    if cfg.overlap.delay_wgrad_compute:
        fields["overlap.delay_wgrad_compute"] = True
    return [error(
        fields,
        f"the model cannot build a schedule plan ({reason}); the combined-1F1B overlap schedule would "
        "fail at its first step",
        f"{_TURN_OFF} (keeping delay_wgrad_compute alone is not a substitute)",
    )]


@rule("overlap.cuda_graphs",
      "policy: overlap_moe_expert_parallel_comm needs cuda_graph_impl=none (the Hybrid schedule plan "
      "cannot run inside CUDA graphs)",
      fix="either keep overlap and drop graphs: cuda_graphs.cuda_graph_impl=none cuda_graphs.paged_stash=false; "
          "or keep graphs and drop overlap: overlap.overlap_moe_expert_parallel_comm=false "
          "overlap.delay_wgrad_compute=false")
def overlap_cuda_graphs(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    g = cfg.cuda_graphs
    if not _overlap_on(cfg) or g.cuda_graph_impl == "none":
        return []
    # docs/megatron-rules.md, "CUDA graphs policy", and docs/upstream-failures.md: the upstream schedule plan
    # requires cuda_graph_impl == "none"; no validated configuration of graphs + overlap exists.
    return [error(
        {**_OVERLAP_FIELD, "cuda_graphs.cuda_graph_impl": g.cuda_graph_impl, "cuda_graphs.paged_stash": g.paged_stash},
        f"EP overlap with cuda_graph_impl={g.cuda_graph_impl!r} is not a validated configuration: the "
        "Hybrid overlap schedule plan requires cuda_graph_impl='none'",
    )]


@rule("delay_wgrad.requires_overlap", "delay_wgrad_compute needs overlap_moe_expert_parallel_comm",
      fix="set overlap.delay_wgrad_compute=false, or turn on overlap.overlap_moe_expert_parallel_comm")
def delay_wgrad_requires_overlap(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not cfg.overlap.delay_wgrad_compute or _overlap_on(cfg):
        return []
    return [error({"overlap.delay_wgrad_compute": True, "overlap.overlap_moe_expert_parallel_comm": False},
                  "delayed weight gradients are computed only by the overlap schedule; without it they are lost")]
