"""EP all-to-all overlap and delayed wgrad: Megatron's requirements, the model's capability and the CUDA-graph policy."""

from __future__ import annotations

from typing import Any

from gptoss_cli.model.pattern import HybridPattern
from gptoss_cli.recipe.rules.core import Context, Finding, error, rule, short_pattern, version_tuple
from gptoss_cli.recipe.schema import RecipeConfig


# --- EP all-to-all overlap and delayed wgrad (docs/megatron-rules.md) --------------------------
def _overlap_on(cfg: RecipeConfig) -> bool:
    return bool(cfg.overlap.overlap_moe_expert_parallel_comm)


_OVERLAP_FIELD = {"overlap.overlap_moe_expert_parallel_comm": True}
_TURN_OFF = "turn overlap off: overlap.overlap_moe_expert_parallel_comm=false overlap.delay_wgrad_compute=false"
_OVERLAP_OFF = f"or {_TURN_OFF}"


@rule("overlap.requires_expert_parallel", "overlap_moe_expert_parallel_comm needs EP > 1",
      fix=f"set parallelism.expert_model_parallel_size >= 2, {_OVERLAP_OFF}")
def overlap_requires_ep(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    ep = cfg.parallelism.expert_model_parallel_size
    if not _overlap_on(cfg) or ep > 1:
        return []
    return [error({**_OVERLAP_FIELD, "parallelism.expert_model_parallel_size": ep},
                  "EP all-to-all overlap needs expert parallelism, but EP=1 (there is no all-to-all to hide)")]


@rule("overlap.requires_multiple_experts", "overlap_moe_expert_parallel_comm needs more than one expert",
      fix=_TURN_OFF)
def overlap_requires_experts(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    n = ctx.arch.num_local_experts
    if not _overlap_on(cfg) or n > 1:
        return []
    return [error({**_OVERLAP_FIELD, "num_local_experts": n}, "EP overlap needs more than one expert")]


@rule("overlap.dispatcher", "overlap_moe_expert_parallel_comm needs the alltoall or flex dispatcher",
      fix=f"set moe.token_dispatcher_type=alltoall, {_OVERLAP_OFF}")
def overlap_dispatcher(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    d = cfg.moe.token_dispatcher_type
    if not _overlap_on(cfg) or d in ("alltoall", "flex"):
        return []
    return [error({**_OVERLAP_FIELD, "moe.token_dispatcher_type": d},
                  f"EP overlap works with the alltoall or flex dispatcher, not {d!r}")]


@rule("overlap.precision", "overlap_moe_expert_parallel_comm needs bf16 or fp16 parameters",
      fix=f"set precision.params_dtype=bf16, {_OVERLAP_OFF}")
def overlap_precision(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    dt = cfg.precision.params_dtype
    if not _overlap_on(cfg) or dt in ("bf16", "fp16"):
        return []
    return [error({**_OVERLAP_FIELD, "precision.params_dtype": dt},
                  f"EP overlap needs bf16 or fp16, but params_dtype={dt}")]


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


@rule("overlap.shared_expert_overlap", "overlap_moe_expert_parallel_comm excludes shared-expert overlap",
      fix=f"set moe.shared_expert_overlap=false, {_OVERLAP_OFF}")
def overlap_shared_expert(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not _overlap_on(cfg) or not cfg.moe.shared_expert_overlap:
        return []
    return [error({**_OVERLAP_FIELD, "moe.shared_expert_overlap": True},
                  "EP overlap and shared-expert overlap cannot both be on")]


@rule("overlap.mtp_num_layers", "overlap_moe_expert_parallel_comm needs mtp_num_layers in (null, 0, 1)",
      fix=f"set model.mtp_num_layers=0, {_OVERLAP_OFF}")
def overlap_mtp(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    n = cfg.model.mtp_num_layers
    if not _overlap_on(cfg) or n in (None, 0, 1):
        return []
    return [error({**_OVERLAP_FIELD, "model.mtp_num_layers": n},
                  f"EP overlap supports at most one MTP layer, got mtp_num_layers={n}")]


@rule("overlap.pipeline_requires_virtual", "overlap_moe_expert_parallel_comm with PP > 1 needs virtual pipeline",
      fix=f"set parallelism.virtual_pipeline_model_parallel_size >= 2, or PP=1, {_OVERLAP_OFF}")
def overlap_pipeline(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    p = cfg.parallelism
    if not _overlap_on(cfg) or p.pipeline_model_parallel_size == 1 or p.virtual_pipeline_model_parallel_size:
        return []
    return [error({**_OVERLAP_FIELD, "parallelism.pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                   "parallelism.virtual_pipeline_model_parallel_size": None},
                  "EP overlap with pipeline parallelism needs the interleaved (virtual) pipeline schedule")]


@rule("overlap.torch_version", "overlap_moe_expert_parallel_comm needs torch >= 2.6",
      fix=f"torch 2.6 or newer, {_OVERLAP_OFF}")
def overlap_torch(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not _overlap_on(cfg) or not ctx.torch_version or version_tuple(ctx.torch_version) >= (2, 6):
        return []
    return [error({**_OVERLAP_FIELD, "torch": ctx.torch_version},
                  f"EP overlap needs torch >= 2.6, this environment has {ctx.torch_version}",
                  f"upgrade torch, {_OVERLAP_OFF}")]


def schedule_plan_support(model_cls: Any, pattern: HybridPattern) -> tuple[bool, str]:
    """Ask a model class whether it can build a combined-1F1B schedule plan for `pattern`.

    The agreed interface: a classmethod `supports_schedule_plan(pattern) -> (bool, reason)`
    next to `build_schedule_plan`. A class lacking either cannot run the overlap schedule.
    """
    if model_cls is None:  # only when a caller passes None: the default class raises if it cannot import
        return False, "the model class given is None"
    name = getattr(model_cls, "__name__", repr(model_cls))
    if not callable(getattr(model_cls, "build_schedule_plan", None)):
        return False, f"{name} has no build_schedule_plan"
    supports = getattr(model_cls, "supports_schedule_plan", None)
    if not callable(supports):
        return False, f"{name} has build_schedule_plan but no supports_schedule_plan(pattern) to confirm the pattern"
    try:
        answer = supports(pattern)
    except Exception as exc:  # a capability query must never crash validation
        return False, f"{name}.supports_schedule_plan raised {type(exc).__name__}: {exc}"
    if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool)):
        return False, f"{name}.supports_schedule_plan returned {answer!r}, not (bool, reason)"
    ok, reason = answer
    return ok, "" if ok else (str(reason) or f"{name} cannot schedule this pattern")


@rule("overlap.schedule_plan",
      "overlap_moe_expert_parallel_comm needs a model class that can build a schedule plan for the pattern",
      fix=f"a pattern the model can schedule ('*E' per block as convert writes, grouped '[*E]', '-' layers),"
          f" {_OVERLAP_OFF}")
def schedule_plan_capability(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not _overlap_on(cfg):
        return []
    ok, reason = schedule_plan_support(ctx.resolved_model_class(), ctx.pattern)
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
