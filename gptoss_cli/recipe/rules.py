"""The rule registry: small functions `rule(cfg, ctx) -> list[Finding]` that validate-config and train run.

Two kinds of rule:
- "semantic": Megatron's own constraints and the model's capabilities (reference sections 5-6);
  a recipe that breaks one cannot work anywhere.
- "unsupported" (ids `unsupported.*`): options `gptoss train` does not implement yet. They are
  errors for the `gptoss` target (what train checks) and notes for the `megatron` target, so a
  64-GPU production recipe can be judged on its semantics while stating what this trainer lacks.

A rule function returns findings built with `error(...)` / `warning(...)`; the registry fills in
the rule id and kind, so each function only says what is wrong and how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Iterable

from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.pattern import ATTENTION, MOE, HybridPattern
from gptoss_cli.recipe.schema import RecipeConfig, iter_fields

ERROR = "error"
WARNING = "warning"
SEMANTIC = "semantic"
UNSUPPORTED = "unsupported"

# What `gptoss train` implements today. Widen an entry when the feature lands and its
# unsupported.* rule goes quiet; nothing else needs to change.
IMPLEMENTED = {
    "token_dispatchers": frozenset({"alltoall"}),
    "fp8_recipes": frozenset({"none", "tensorwise", "rowwise", "mxfp8"}),  # gptoss_cli/fp8/
    "checkpoint_formats": frozenset({"gptoss"}),
}

# GPU generations: native FP8 GEMMs need Hopper (sm90) or newer; MXFP8 block scaling is a
# Blackwell (sm100) feature.
_HOPPER_OR_NEWER = frozenset({"h100", "h200", "b200", "gb200", "gb300"})
_BLACKWELL = frozenset({"b200", "gb200", "gb300"})


@dataclass(frozen=True)
class Finding:
    """One problem: which rule, how bad, which fields with which values, what is wrong, the fix."""

    rule: str
    severity: str  # "error" | "warning"
    fields: dict[str, Any]
    message: str
    hint: str = ""
    kind: str = SEMANTIC  # "semantic" | "unsupported"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def error(fields: dict[str, Any], message: str, hint: str = "") -> Finding:
    return Finding(rule="", severity=ERROR, fields=fields, message=message, hint=hint)


def warning(fields: dict[str, Any], message: str, hint: str = "") -> Finding:
    return Finding(rule="", severity=WARNING, fields=fields, message=message, hint=hint)


# --- context ---------------------------------------------------------------------------------
_LAZY = object()


def default_model_class() -> Any:
    """gptoss_cli.model.hybrid.HybridModel, or None when it cannot be imported (yet)."""
    try:
        from gptoss_cli.model.hybrid import HybridModel  # noqa: PLC0415 - lazy: the model may not exist yet
    except Exception:  # a missing module or a broken one: either way there is no usable model class
        return None
    return HybridModel


@dataclass
class Context:
    """What rules need besides the config: the model, the world size, the target machine."""

    arch: GptOssArch
    pattern: HybridPattern
    world_size: int
    world_size_source: str
    explicit_world_size: int | None = None
    gpu: str = "auto"  # the GPU generation (recipe's system.gpu, or detected by train)
    torch_version: str = ""
    check_paths: bool = False  # train sets this: data and checkpoint paths must exist here
    model_class: Any = _LAZY

    def resolved_model_class(self) -> Any:
        if self.model_class is _LAZY:
            self.model_class = default_model_class()
        return self.model_class


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
    """world / (ETP x EP x PP) (reference section 5), or None when that does not divide."""
    emp = expert_model_parallel_product(cfg)
    return world // emp if emp > 0 and world > 0 and world % emp == 0 else None


def gpu_from_device_name(name: str | None) -> str:
    """The system.gpu value for a CUDA device name (torch.cuda.get_device_name()); "auto" if unknown.

    train passes it as `validate_recipe(..., gpu=...)` so FP8 rules judge the GPU it runs on.
    """
    if not name:
        return "none"
    text = name.lower().replace("-", " ")
    for key in ("gb300", "gb200", "b200", "h200", "h100", "a100"):
        if key in text.replace(" ", ""):
            return key
    return "auto"


def installed_torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # pragma: no cover - torch is a dependency
        return ""


# --- the registry ----------------------------------------------------------------------------
RuleFn = Callable[[RecipeConfig, Context], "Iterable[Finding] | None"]


@dataclass(frozen=True)
class Rule:
    id: str
    kind: str
    description: str
    fn: RuleFn = field(repr=False)

    def __call__(self, cfg: RecipeConfig, ctx: Context) -> list[Finding]:
        return [dataclasses.replace(f, rule=self.id, kind=self.kind) for f in (self.fn(cfg, ctx) or [])]


RULES: dict[str, Rule] = {}


def rule(rule_id: str, description: str, *, kind: str = SEMANTIC) -> Callable[[RuleFn], RuleFn]:
    """Register `fn(cfg, ctx) -> list[Finding]` under `rule_id`; the function stays callable as is."""

    def register(fn: RuleFn) -> RuleFn:
        if rule_id in RULES:
            raise ValueError(f"rule {rule_id!r} registered twice")
        RULES[rule_id] = Rule(rule_id, kind, description, fn)
        return fn

    return register


def list_rules() -> list[tuple[str, str, str]]:
    """(id, kind, description) of every rule, in the order they run (the README's rule list)."""
    return [(r.id, r.kind, r.description) for r in RULES.values()]


# --- field bounds ----------------------------------------------------------------------------
@rule("field.range", "numbers at or above their minimum (sizes >= 1, rates >= 0, ...)")
def field_range(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    out = []
    for dotted, f in iter_fields():
        low = f.metadata.get("min")
        if low is None:
            continue
        value = _get(cfg, dotted)
        if value is not None and not isinstance(value, bool) and value < low:
            out.append(error({dotted: value}, f"{dotted}={value} is below its minimum {low}",
                             f"set {dotted} to a value >= {low}"))
    return out


# --- the model -------------------------------------------------------------------------------
@rule("model.pattern_matches_architecture",
      "hybrid_layer_pattern is one '*E' pair per HF block (attention then MoE), as the weights map")
def pattern_matches_architecture(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    expected = (ATTENTION, MOE) * ctx.arch.num_hidden_layers
    if ctx.pattern.layers == expected:
        return []
    return [error(
        {"model.hybrid_layer_pattern": _short_pattern(ctx.pattern.text),
         "model.num_hidden_layers": ctx.arch.num_hidden_layers},
        f"pattern has layers {_short_pattern(''.join(ctx.pattern.layers))} but GPT-OSS with "
        f"{ctx.arch.num_hidden_layers} blocks needs '*E' x {ctx.arch.num_hidden_layers} "
        "(HF block i -> attention layer 2i, MoE layer 2i+1)",
        "set model.hybrid_layer_pattern=null (derived from the architecture) or change "
        "model.architecture.num_hidden_layers",
    )]


@rule("model.mtp_layers", "mtp_num_layers > 0 needs a model with MTP layers; GPT-OSS has none")
def mtp_layers(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    n = cfg.model.mtp_num_layers
    if n is None or n <= 0:
        return []
    return [error({"model.mtp_num_layers": n},
                  f"mtp_num_layers={n} asks for multi-token-prediction layers, which GPT-OSS does not have",
                  "set model.mtp_num_layers=0 (or null)")]


@rule("model.seq_within_positions", "training.seq_length <= the model's max_position_embeddings")
def seq_within_positions(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    seq, cap = cfg.training.seq_length, ctx.arch.max_position_embeddings
    if seq <= cap:
        return []
    return [error({"training.seq_length": seq, "max_position_embeddings": cap},
                  f"seq_length={seq} exceeds the model's max_position_embeddings={cap}",
                  f"set training.seq_length <= {cap}")]


# --- parallel arithmetic -----------------------------------------------------------------------
@rule("parallel.world_size_consistent",
      "world size from --world-size, parallelism.world_size and nodes x gpus_per_node agree")
def world_size_consistent(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    p, out = cfg.parallelism, []
    if p.world_size is not None and p.nodes is not None and p.gpus_per_node is not None:
        if p.nodes * p.gpus_per_node != p.world_size:
            out.append(error(
                {"parallelism.world_size": p.world_size, "parallelism.nodes": p.nodes,
                 "parallelism.gpus_per_node": p.gpus_per_node},
                f"world_size={p.world_size} but nodes x gpus_per_node = {p.nodes * p.gpus_per_node}",
                "make them agree, or drop parallelism.world_size"))
    recipe_world = p.world_size if p.world_size is not None else (
        p.nodes * p.gpus_per_node if p.nodes is not None and p.gpus_per_node is not None else None)
    if ctx.explicit_world_size is not None and recipe_world is not None and ctx.explicit_world_size != recipe_world:
        out.append(warning(
            {"world_size": ctx.explicit_world_size, "parallelism.world_size": recipe_world},
            f"checking with world size {ctx.explicit_world_size}, but the recipe is written for {recipe_world}",
            "batch arithmetic below uses the launched world size; update parallelism.world_size to match"))
    return out


@rule("parallel.world_divisible", "world size divisible by TP x PP x CP (the rest is data parallel)")
def world_divisible(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    mp = model_parallel_size(cfg)
    if ctx.world_size % mp == 0:
        return []
    p = cfg.parallelism
    return [error(
        {"world_size": ctx.world_size, "parallelism.tensor_model_parallel_size": p.tensor_model_parallel_size,
         "parallelism.pipeline_model_parallel_size": p.pipeline_model_parallel_size,
         "parallelism.context_parallel_size": p.context_parallel_size},
        f"world size {ctx.world_size} is not divisible by TP x PP x CP = {mp}",
        f"use a world size that is a multiple of {mp}, or smaller model-parallel sizes")]


@rule("parallel.expert_world_divisible",
      "world size divisible by ETP x EP x PP (the rest is expert data parallel)")
def expert_world_divisible(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    emp = expert_model_parallel_product(cfg)
    if ctx.world_size % emp == 0:
        return []
    p = cfg.parallelism
    return [error(
        {"world_size": ctx.world_size, "parallelism.expert_model_parallel_size": p.expert_model_parallel_size,
         "parallelism.expert_tensor_parallel_size": p.expert_tensor_parallel_size,
         "parallelism.pipeline_model_parallel_size": p.pipeline_model_parallel_size},
        f"world size {ctx.world_size} is not divisible by ETP x EP x PP = {emp}",
        f"use a world size that is a multiple of {emp}, or a smaller expert_model_parallel_size")]


@rule("parallel.data_parallel_consistent", "an explicit data_parallel_size equals world / (TP x PP x CP)")
def data_parallel_consistent(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    want = cfg.parallelism.data_parallel_size
    dp = data_parallel_size(cfg, ctx.world_size)
    if want is None or dp is None or want == dp:
        return []
    return [error({"parallelism.data_parallel_size": want, "world_size": ctx.world_size},
                  f"data_parallel_size={want} but world size {ctx.world_size} / (TP x PP x CP) = {dp}",
                  "set parallelism.data_parallel_size=null to derive it, or change the world size")]


@rule("parallel.experts_divisible", "num_local_experts divisible by expert_model_parallel_size")
def experts_divisible(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    ep, experts = cfg.parallelism.expert_model_parallel_size, ctx.arch.num_local_experts
    if experts % ep == 0:
        return []
    return [error({"parallelism.expert_model_parallel_size": ep, "num_local_experts": experts},
                  f"{experts} experts cannot be split evenly over EP={ep}",
                  f"use an expert_model_parallel_size that divides {experts}")]


@rule("parallel.heads_divisible", "attention heads and kv heads divisible by tensor_model_parallel_size")
def heads_divisible(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    tp, a = cfg.parallelism.tensor_model_parallel_size, ctx.arch
    bad = {k: v for k, v in (("num_attention_heads", a.num_attention_heads),
                             ("num_key_value_heads", a.num_key_value_heads)) if v % tp}
    if not bad:
        return []
    return [error({"parallelism.tensor_model_parallel_size": tp, **bad},
                  f"TP={tp} does not divide {', '.join(f'{k}={v}' for k, v in bad.items())}",
                  f"use a tensor_model_parallel_size that divides {math.gcd(a.num_attention_heads, a.num_key_value_heads)}")]


@rule("parallel.batch_divisible", "global_batch_size divisible by micro_batch_size x data parallel size")
def batch_divisible(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    dp = data_parallel_size(cfg, ctx.world_size)
    if dp is None:
        return []  # parallel.world_divisible reports it
    t = cfg.training
    step = t.micro_batch_size * dp
    if t.global_batch_size % step == 0:
        return []
    return [error({"training.global_batch_size": t.global_batch_size,
                   "training.micro_batch_size": t.micro_batch_size, "data_parallel_size": dp},
                  f"global_batch_size={t.global_batch_size} is not a multiple of micro_batch_size x DP = {step}",
                  f"set training.global_batch_size to a multiple of {step} (e.g. "
                  f"{max(step, t.global_batch_size // step * step)})")]


@rule("parallel.pipeline_layers",
      "pipeline stages: '|' splits match PP, or layers divide evenly into PP (x VPP) stages")
def pipeline_layers(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    p, out = cfg.parallelism, []
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    if vpp is not None and pp == 1:
        out.append(error({"parallelism.virtual_pipeline_model_parallel_size": vpp,
                          "parallelism.pipeline_model_parallel_size": pp},
                         "virtual pipeline stages need pipeline parallelism (PP > 1)",
                         "set parallelism.virtual_pipeline_model_parallel_size=null"))
    stages = ctx.pattern.num_pipeline_stages
    if ctx.pattern.pipeline_splits:
        if stages != pp * (vpp or 1):
            out.append(error({"model.hybrid_layer_pattern": _short_pattern(ctx.pattern.text), "stages": stages,
                              "parallelism.pipeline_model_parallel_size": pp},
                             f"the pattern's '|' splits make {stages} stages but PP x VPP = {pp * (vpp or 1)}",
                             "add or remove '|' splits, or change the pipeline sizes"))
    elif pp > 1 and ctx.pattern.num_layers % (pp * (vpp or 1)):
        out.append(error({"layers": ctx.pattern.num_layers, "parallelism.pipeline_model_parallel_size": pp,
                          "parallelism.virtual_pipeline_model_parallel_size": vpp},
                         f"{ctx.pattern.num_layers} layers do not divide into PP x VPP = {pp * (vpp or 1)} stages",
                         "mark stage boundaries with '|' in model.hybrid_layer_pattern, or change PP/VPP"))
    return out


@rule("parallel.context_parallel_seq", "with CP > 1, seq_length divisible by 2 x CP (load-balanced halves)")
def context_parallel_seq(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    cp, seq = cfg.parallelism.context_parallel_size, cfg.training.seq_length
    if cp == 1 or seq % (2 * cp) == 0:
        return []
    return [error({"parallelism.context_parallel_size": cp, "training.seq_length": seq},
                  f"seq_length={seq} is not divisible by 2 x CP = {2 * cp}",
                  f"use a seq_length that is a multiple of {2 * cp}")]


@rule("parallel.sequence_parallel", "sequence_parallel needs TP > 1 and seq_length divisible by TP")
def sequence_parallel(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    p, seq = cfg.parallelism, cfg.training.seq_length
    if not p.sequence_parallel:
        return []
    if p.tensor_model_parallel_size == 1:
        return [warning({"parallelism.sequence_parallel": True, "parallelism.tensor_model_parallel_size": 1},
                        "sequence_parallel has no effect with TP=1", "set parallelism.sequence_parallel=false")]
    if seq % p.tensor_model_parallel_size:
        return [error({"parallelism.sequence_parallel": True, "training.seq_length": seq,
                       "parallelism.tensor_model_parallel_size": p.tensor_model_parallel_size},
                      f"seq_length={seq} is not divisible by TP={p.tensor_model_parallel_size}",
                      "use a seq_length that is a multiple of TP")]
    return []


@rule("moe.sequence_parallel_with_tp", "expert parallelism together with TP > 1 requires sequence_parallel")
def moe_sequence_parallel(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    p = cfg.parallelism
    if p.expert_model_parallel_size > 1 and p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
        return [error({"parallelism.expert_model_parallel_size": p.expert_model_parallel_size,
                       "parallelism.tensor_model_parallel_size": p.tensor_model_parallel_size,
                       "parallelism.sequence_parallel": False},
                      "MoE with EP > 1 and TP > 1 needs sequence parallelism (Megatron's requirement)",
                      "set parallelism.sequence_parallel=true")]
    return []


@rule("moe.capacity_factor", "capacity_factor, when set, is > 0")
def capacity_factor(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    cf = cfg.moe.capacity_factor
    if cf is None or cf > 0:
        return []
    return [error({"moe.capacity_factor": cf}, f"capacity_factor={cf} would drop every token",
                  "set moe.capacity_factor=null for dropless routing, or a value > 0")]


@rule("moe.shared_expert_overlap", "shared_expert_overlap needs shared experts; GPT-OSS has none")
def shared_expert_overlap_needs_shared(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not cfg.moe.shared_expert_overlap:
        return []
    return [error({"moe.shared_expert_overlap": True}, "GPT-OSS has no shared experts to overlap",
                  "set moe.shared_expert_overlap=false")]


# --- EP all-to-all overlap and delayed wgrad (reference section 5) -------------------------------
def _overlap_on(cfg: RecipeConfig) -> bool:
    return bool(cfg.overlap.overlap_moe_expert_parallel_comm)


_OVERLAP_FIELD = {"overlap.overlap_moe_expert_parallel_comm": True}
_TURN_OFF = "turn overlap off: overlap.overlap_moe_expert_parallel_comm=false overlap.delay_wgrad_compute=false"
_OVERLAP_OFF = f"or {_TURN_OFF}"


@rule("overlap.requires_expert_parallel", "overlap_moe_expert_parallel_comm needs EP > 1")
def overlap_requires_ep(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    ep = cfg.parallelism.expert_model_parallel_size
    if not _overlap_on(cfg) or ep > 1:
        return []
    return [error({**_OVERLAP_FIELD, "parallelism.expert_model_parallel_size": ep},
                  "EP all-to-all overlap needs expert parallelism, but EP=1 (there is no all-to-all to hide)",
                  f"set parallelism.expert_model_parallel_size >= 2, {_OVERLAP_OFF}")]


@rule("overlap.requires_multiple_experts", "overlap_moe_expert_parallel_comm needs more than one expert")
def overlap_requires_experts(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    n = ctx.arch.num_local_experts
    if not _overlap_on(cfg) or n > 1:
        return []
    return [error({**_OVERLAP_FIELD, "num_local_experts": n}, "EP overlap needs more than one expert",
                  _TURN_OFF)]


@rule("overlap.dispatcher", "overlap_moe_expert_parallel_comm needs the alltoall or flex dispatcher")
def overlap_dispatcher(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    d = cfg.moe.token_dispatcher_type
    if not _overlap_on(cfg) or d in ("alltoall", "flex"):
        return []
    return [error({**_OVERLAP_FIELD, "moe.token_dispatcher_type": d},
                  f"EP overlap works with the alltoall or flex dispatcher, not {d!r}",
                  f"set moe.token_dispatcher_type=alltoall, {_OVERLAP_OFF}")]


@rule("overlap.precision", "overlap_moe_expert_parallel_comm needs bf16 or fp16 parameters")
def overlap_precision(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    dt = cfg.precision.params_dtype
    if not _overlap_on(cfg) or dt in ("bf16", "fp16"):
        return []
    return [error({**_OVERLAP_FIELD, "precision.params_dtype": dt},
                  f"EP overlap needs bf16 or fp16, but params_dtype={dt}",
                  f"set precision.params_dtype=bf16, {_OVERLAP_OFF}")]


@rule("overlap.recompute", "overlap_moe_expert_parallel_comm forbids full recompute and recompute of 'moe'")
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


@rule("overlap.shared_expert_overlap", "overlap_moe_expert_parallel_comm excludes shared-expert overlap")
def overlap_shared_expert(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not _overlap_on(cfg) or not cfg.moe.shared_expert_overlap:
        return []
    return [error({**_OVERLAP_FIELD, "moe.shared_expert_overlap": True},
                  "EP overlap and shared-expert overlap cannot both be on",
                  f"set moe.shared_expert_overlap=false, {_OVERLAP_OFF}")]


@rule("overlap.mtp_num_layers", "overlap_moe_expert_parallel_comm needs mtp_num_layers in (null, 0, 1)")
def overlap_mtp(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    n = cfg.model.mtp_num_layers
    if not _overlap_on(cfg) or n in (None, 0, 1):
        return []
    return [error({**_OVERLAP_FIELD, "model.mtp_num_layers": n},
                  f"EP overlap supports at most one MTP layer, got mtp_num_layers={n}",
                  f"set model.mtp_num_layers=0, {_OVERLAP_OFF}")]


@rule("overlap.pipeline_requires_virtual", "overlap_moe_expert_parallel_comm with PP > 1 needs virtual pipeline")
def overlap_pipeline(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    p = cfg.parallelism
    if not _overlap_on(cfg) or p.pipeline_model_parallel_size == 1 or p.virtual_pipeline_model_parallel_size:
        return []
    return [error({**_OVERLAP_FIELD, "parallelism.pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                   "parallelism.virtual_pipeline_model_parallel_size": None},
                  "EP overlap with pipeline parallelism needs the interleaved (virtual) pipeline schedule",
                  f"set parallelism.virtual_pipeline_model_parallel_size >= 2, or PP=1, {_OVERLAP_OFF}")]


@rule("overlap.torch_version", "overlap_moe_expert_parallel_comm needs torch >= 2.6")
def overlap_torch(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not _overlap_on(cfg) or not ctx.torch_version or _version_tuple(ctx.torch_version) >= (2, 6):
        return []
    return [error({**_OVERLAP_FIELD, "torch": ctx.torch_version},
                  f"EP overlap needs torch >= 2.6, this environment has {ctx.torch_version}",
                  f"upgrade torch, {_OVERLAP_OFF}")]


def schedule_plan_support(model_cls: Any, pattern: HybridPattern) -> tuple[bool, str]:
    """Ask a model class whether it can build a combined-1F1B schedule plan for `pattern`.

    The agreed interface: a classmethod `supports_schedule_plan(pattern) -> (bool, reason)`
    next to `build_schedule_plan`. A class lacking either cannot run the overlap schedule.
    """
    if model_cls is None:
        return False, "gptoss_cli.model.hybrid.HybridModel cannot be imported"
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
      "overlap_moe_expert_parallel_comm needs a model class that can build a schedule plan for the pattern")
def schedule_plan_capability(cfg: RecipeConfig, ctx: Context, model_cls: Any = _LAZY) -> list[Finding]:
    if not _overlap_on(cfg):
        return []
    if model_cls is _LAZY:
        model_cls = ctx.resolved_model_class()
    ok, reason = schedule_plan_support(model_cls, ctx.pattern)
    if ok:
        return []
    fields = {**_OVERLAP_FIELD, "model.hybrid_layer_pattern": _short_pattern(ctx.pattern.text)}
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
      "cannot run inside CUDA graphs)")
def overlap_cuda_graphs(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    g = cfg.cuda_graphs
    if not _overlap_on(cfg) or g.cuda_graph_impl == "none":
        return []
    # Reference section 5 and the HybridModel EP-overlap field report: the upstream schedule plan
    # requires cuda_graph_impl == "none"; no validated configuration of graphs + overlap exists.
    return [error(
        {**_OVERLAP_FIELD, "cuda_graphs.cuda_graph_impl": g.cuda_graph_impl, "cuda_graphs.paged_stash": g.paged_stash},
        f"EP overlap with cuda_graph_impl={g.cuda_graph_impl!r} is not a validated configuration: the "
        "Hybrid overlap schedule plan requires cuda_graph_impl='none'",
        "either keep overlap and drop graphs: cuda_graphs.cuda_graph_impl=none cuda_graphs.paged_stash=false; "
        "or keep graphs and drop overlap: overlap.overlap_moe_expert_parallel_comm=false "
        "overlap.delay_wgrad_compute=false",
    )]


@rule("delay_wgrad.requires_overlap", "delay_wgrad_compute needs overlap_moe_expert_parallel_comm")
def delay_wgrad_requires_overlap(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not cfg.overlap.delay_wgrad_compute or _overlap_on(cfg):
        return []
    return [error({"overlap.delay_wgrad_compute": True, "overlap.overlap_moe_expert_parallel_comm": False},
                  "delayed weight gradients are computed only by the overlap schedule; without it they are lost",
                  "set overlap.delay_wgrad_compute=false, or turn on overlap.overlap_moe_expert_parallel_comm")]


# --- CUDA graphs and recompute -------------------------------------------------------------------
@rule("cuda_graphs.paged_stash_requires_full_iteration", "paged_stash needs cuda_graph_impl=full_iteration")
def paged_stash(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    g = cfg.cuda_graphs
    if not g.paged_stash or g.cuda_graph_impl == "full_iteration":
        return []
    return [error({"cuda_graphs.paged_stash": True, "cuda_graphs.cuda_graph_impl": g.cuda_graph_impl},
                  "the paged activation stash exists only for full-iteration CUDA graphs",
                  "set cuda_graphs.paged_stash=false, or cuda_graphs.cuda_graph_impl=full_iteration")]


@rule("cuda_graphs.requires_cuda", "CUDA graphs need system.device=cuda (or auto)")
def graphs_need_cuda(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    g = cfg.cuda_graphs
    if g.cuda_graph_impl == "none" or cfg.system.device != "cpu":
        return []
    return [error({"cuda_graphs.cuda_graph_impl": g.cuda_graph_impl, "system.device": "cpu"},
                  "CUDA graphs cannot run on the CPU", "set cuda_graphs.cuda_graph_impl=none")]


@rule("cuda_graphs.scope", "cuda_graph_scope applies to cuda_graph_impl=local only")
def graph_scope(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    g = cfg.cuda_graphs
    if not g.cuda_graph_scope or g.cuda_graph_impl == "local":
        return []
    return [warning({"cuda_graphs.cuda_graph_scope": list(g.cuda_graph_scope),
                     "cuda_graphs.cuda_graph_impl": g.cuda_graph_impl},
                    f"cuda_graph_scope is ignored with cuda_graph_impl={g.cuda_graph_impl!r}",
                    "set cuda_graphs.cuda_graph_scope=[]")]


@rule("recompute.settings",
      "full recompute needs method + num_layers; selective takes modules, not method/num_layers")
def recompute_settings(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    r = cfg.recompute
    fields = {"recompute.recompute_granularity": r.recompute_granularity}
    if r.recompute_granularity == "full":
        if r.recompute_method is None or r.recompute_num_layers is None:
            return [error({**fields, "recompute.recompute_method": r.recompute_method,
                           "recompute.recompute_num_layers": r.recompute_num_layers},
                          "full recompute needs recompute_method and recompute_num_layers",
                          "e.g. recompute.recompute_method=uniform recompute.recompute_num_layers=1")]
        if r.recompute_modules:
            return [warning({**fields, "recompute.recompute_modules": list(r.recompute_modules)},
                            "recompute_modules is ignored with full recompute", "set recompute.recompute_modules=[]")]
        return []
    if r.recompute_method is not None or r.recompute_num_layers is not None:
        return [error({**fields, "recompute.recompute_method": r.recompute_method,
                       "recompute.recompute_num_layers": r.recompute_num_layers},
                      f"recompute_method/num_layers apply to full recompute only, granularity is "
                      f"{r.recompute_granularity!r}",
                      "set recompute.recompute_method=null recompute.recompute_num_layers=null")]
    if r.recompute_granularity == "selective" and not r.recompute_modules:
        return [error(fields, "selective recompute with no recompute_modules recomputes nothing",
                      "e.g. recompute.recompute_modules=[core_attn]")]
    if r.recompute_granularity == "none" and r.recompute_modules:
        return [warning({**fields, "recompute.recompute_modules": list(r.recompute_modules)},
                        "recompute_modules is ignored without selective recompute",
                        "set recompute.recompute_granularity=selective, or recompute.recompute_modules=[]")]
    return []


# --- FP8 -----------------------------------------------------------------------------------------
@rule("fp8.mxfp8_dims", "MXFP8 needs every GEMM dimension divisible by 32 (one scale per 32 values)")
def mxfp8_dims(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if cfg.precision.fp8_recipe != "mxfp8":
        return []
    a = ctx.arch
    dims = {"hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
            "num_attention_heads x head_dim": a.num_attention_heads * a.head_dim, "qkv rows": a.qkv_rows}
    bad = {k: v for k, v in dims.items() if v % 32}
    if not bad:
        return []
    return [error({"precision.fp8_recipe": "mxfp8", **bad},
                  f"MXFP8 scales blocks of 32 values, but {', '.join(f'{k}={v}' for k, v in bad.items())} "
                  "is not a multiple of 32",
                  "use precision.fp8_recipe=tensorwise or rowwise, or dimensions divisible by 32")]


@rule("fp8.native_gpu",
      "FP8 needs a GPU with native kernels (Hopper+; MXFP8: Blackwell) unless fp8_emulation is set")
def fp8_native_gpu(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    recipe = cfg.precision.fp8_recipe
    if recipe == "none":
        return []
    need = _BLACKWELL if recipe == "mxfp8" else _HOPPER_OR_NEWER
    need_name = "Blackwell (b200/gb200/gb300)" if recipe == "mxfp8" else "Hopper or newer (h100/h200/b200/gb200/gb300)"
    gpu = "none" if cfg.system.device == "cpu" else ctx.gpu
    fields = {"precision.fp8_recipe": recipe, "system.gpu": gpu, "precision.fp8_emulation": cfg.precision.fp8_emulation}
    if gpu in need:
        return []
    if gpu == "auto":
        return [warning(fields, f"{recipe} needs {need_name}; the GPU is not known until launch",
                        "set system.gpu to check now; train checks the detected GPU")]
    where = "the CPU" if gpu == "none" else gpu
    if cfg.precision.fp8_emulation:
        return [warning(fields, f"{recipe} will be emulated on {where}: same numerics, no speed-up", "")]
    return [error(fields, f"{recipe} has no native kernels on {where}; it needs {need_name}",
                  "run on a supported GPU, set precision.fp8_emulation=true for numerics-only runs, "
                  "or precision.fp8_recipe=none")]


@rule("fp8.mxfp8_expert_bias", "warn: MXFP8 with GPT-OSS's biased experts has produced NaN in a peer")
def mxfp8_expert_bias(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if cfg.precision.fp8_recipe != "mxfp8":
        return []
    # Reference section 5: biased expert outputs saturated the scale in the backward re-quantization.
    return [warning({"precision.fp8_recipe": "mxfp8"},
                    "GPT-OSS experts carry biases; a peer's MXFP8 grouped GEMM went NaN from step 1 "
                    "(scale saturation in the backward re-quantization)",
                    "watch the first steps' loss and grad norm; compare against a bf16 run (gptoss rounds MX "
                    "scales up, so a block maximum never saturates, and adds expert biases outside the GEMM)")]


# --- training, optimizer, data, checkpoints, system ------------------------------------------------
@rule("training.lr_schedule", "min_lr <= lr, warmup_iters <= train_iters, lr_decay_iters >= warmup_iters")
def lr_schedule(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    t, out = cfg.training, []
    if t.min_lr > t.lr:
        out.append(error({"training.lr": t.lr, "training.min_lr": t.min_lr},
                         f"min_lr={t.min_lr} is above the peak lr={t.lr}", "set training.min_lr <= training.lr"))
    if t.warmup_iters > t.train_iters:
        out.append(error({"training.warmup_iters": t.warmup_iters, "training.train_iters": t.train_iters},
                         f"warmup_iters={t.warmup_iters} is longer than the run ({t.train_iters} steps)",
                         "set training.warmup_iters <= training.train_iters"))
    decay = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
    if t.lr_decay_style != "constant" and decay < t.warmup_iters:
        out.append(error({"training.lr_decay_iters": decay, "training.warmup_iters": t.warmup_iters},
                         f"lr decay ends (step {decay}) before warm-up does (step {t.warmup_iters})",
                         "set training.lr_decay_iters >= training.warmup_iters"))
    return out


@rule("optimizer.betas", "AdamW betas in [0, 1)")
def adam_betas(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    o = cfg.optimizer
    bad = {f"optimizer.{k}": v for k, v in (("adam_beta1", o.adam_beta1), ("adam_beta2", o.adam_beta2))
           if not 0.0 <= v < 1.0}
    if not bad:
        return []
    return [error(bad, f"AdamW betas must lie in [0, 1): {bad}", "typical values: adam_beta1=0.9 adam_beta2=0.95")]


@rule("optimizer.param_gather", "overlap_param_gather needs the distributed optimizer and overlap_grad_reduce")
def param_gather(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    o, ov = cfg.optimizer, cfg.overlap
    if not ov.overlap_param_gather or (o.use_distributed_optimizer and ov.overlap_grad_reduce):
        return []
    return [error({"overlap.overlap_param_gather": True, "optimizer.use_distributed_optimizer": o.use_distributed_optimizer,
                   "overlap.overlap_grad_reduce": ov.overlap_grad_reduce},
                  "overlap_param_gather overlaps the distributed optimizer's all-gather and needs "
                  "use_distributed_optimizer and overlap_grad_reduce",
                  "set optimizer.use_distributed_optimizer=true overlap.overlap_grad_reduce=true, "
                  "or overlap.overlap_param_gather=false")]


@rule("data.source", "data.kind=tokens needs data.path; at launch the token files exist and fit the vocabulary")
def data_source(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    d = cfg.data
    if d.kind == "mock":
        if d.path:
            return [warning({"data.kind": "mock", "data.path": d.path}, "data.path is ignored with mock data",
                            "set data.kind=tokens to train on the file")]
        return []
    if not d.path:
        return [error({"data.kind": "tokens", "data.path": None}, "token data needs a file",
                      "set data.path to a token file prefix (see `gptoss prepare-data`), or data.kind=mock")]
    if not ctx.check_paths:
        return []
    # Only at launch (train): the files are on the training machine, not necessarily here.
    from gptoss_cli.errors import GptossError  # noqa: PLC0415
    from gptoss_cli.train.data import read_token_header, token_file_paths  # noqa: PLC0415 - torch, only at launch

    try:
        bin_path, _ = token_file_paths(d.path)
        header = read_token_header(d.path)
        bin_exists = bin_path.is_file()
    except GptossError as exc:
        return [error({"data.path": d.path}, exc.message, exc.hint or "create the files with `gptoss prepare-data`")]
    except (OSError, ValueError) as exc:  # unreadable, or a name the file system cannot hold
        return [error({"data.path": d.path}, f"token files for {d.path!r} cannot be read: {exc}",
                      "create the files with `gptoss prepare-data`")]
    if not bin_exists:
        return [error({"data.path": d.path}, f"token file {bin_path} does not exist",
                      "create it with `gptoss prepare-data`")]
    vocab = header.get("vocab_size")
    if isinstance(vocab, int) and vocab > ctx.arch.vocab_size:
        return [error({"data.path": d.path, "header vocab_size": vocab, "model vocab_size": ctx.arch.vocab_size},
                      f"the token file was made with a {vocab}-token vocabulary, the model has {ctx.arch.vocab_size}",
                      "tokenize with the model's tokenizer")]
    return []


@rule("checkpoint.settings", "save_interval needs a checkpoint dir; at launch, pretrained weights exist")
def checkpoint_settings(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    c, out = cfg.checkpoint, []
    if c.save_interval is not None and not c.dir:
        out.append(error({"checkpoint.save_interval": c.save_interval, "checkpoint.dir": None},
                         "save_interval is set but there is no checkpoint directory",
                         "set checkpoint.dir, or checkpoint.save_interval=null"))
    if ctx.check_paths and c.pretrained:
        from pathlib import Path  # noqa: PLC0415

        try:
            exists = Path(c.pretrained).expanduser().exists()
        except (OSError, ValueError):  # a name the file system cannot hold
            exists = False
        if not exists:
            out.append(error({"checkpoint.pretrained": c.pretrained},
                             f"pretrained weights {c.pretrained!r} do not exist",
                             "convert them first (`gptoss convert`) or fix the path"))
    return out


@rule("system.backend", "the distributed backend suits the device (nccl needs cuda)")
def system_backend(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    dev, be = cfg.system.device, cfg.parallelism.backend
    if dev == "cpu" and be == "nccl":
        return [error({"system.device": "cpu", "parallelism.backend": "nccl"}, "nccl cannot run on the CPU",
                      "set parallelism.backend=gloo (or auto)")]
    if dev == "cuda" and be == "gloo":
        return [warning({"system.device": "cuda", "parallelism.backend": "gloo"},
                        "gloo on GPUs copies every collective through the host", "set parallelism.backend=nccl (or auto)")]
    return []


# --- options gptoss train does not implement yet ---------------------------------------------------
def _unsupported(fields: dict[str, Any], what: str, fix: str) -> Finding:
    return error(fields, f"{what} is not implemented in gptoss yet", fix)


@rule("unsupported.tensor_parallel", "tensor parallelism / sequence parallelism", kind=UNSUPPORTED)
def unsupported_tp(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    p = cfg.parallelism
    if p.tensor_model_parallel_size == 1 and not p.sequence_parallel:
        return []
    return [_unsupported({"parallelism.tensor_model_parallel_size": p.tensor_model_parallel_size,
                          "parallelism.sequence_parallel": p.sequence_parallel},
                         "tensor/sequence parallelism",
                         "set parallelism.tensor_model_parallel_size=1 parallelism.sequence_parallel=false")]


@rule("unsupported.pipeline_parallel", "pipeline and virtual pipeline parallelism", kind=UNSUPPORTED)
def unsupported_pp(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    p = cfg.parallelism
    if p.pipeline_model_parallel_size == 1 and p.virtual_pipeline_model_parallel_size is None \
            and not ctx.pattern.pipeline_splits:
        return []
    return [_unsupported({"parallelism.pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                          "parallelism.virtual_pipeline_model_parallel_size": p.virtual_pipeline_model_parallel_size},
                         "pipeline parallelism",
                         "set parallelism.pipeline_model_parallel_size=1, virtual size null, no '|' in the pattern")]


@rule("unsupported.context_parallel", "context parallelism", kind=UNSUPPORTED)
def unsupported_cp(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    cp = cfg.parallelism.context_parallel_size
    if cp == 1:
        return []
    return [_unsupported({"parallelism.context_parallel_size": cp}, "context parallelism",
                         "set parallelism.context_parallel_size=1")]


@rule("unsupported.expert_tensor_parallel", "expert tensor parallelism", kind=UNSUPPORTED)
def unsupported_etp(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    etp = cfg.parallelism.expert_tensor_parallel_size
    if etp == 1:
        return []
    return [_unsupported({"parallelism.expert_tensor_parallel_size": etp}, "expert tensor parallelism",
                         "set parallelism.expert_tensor_parallel_size=1")]


@rule("unsupported.megatron_fsdp", "Megatron FSDP", kind=UNSUPPORTED)
def unsupported_fsdp(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not cfg.parallelism.use_megatron_fsdp:
        return []
    return [_unsupported({"parallelism.use_megatron_fsdp": True}, "Megatron FSDP",
                         "set parallelism.use_megatron_fsdp=false")]


@rule("unsupported.token_dispatcher", "token dispatchers other than alltoall", kind=UNSUPPORTED)
def unsupported_dispatcher(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    d = cfg.moe.token_dispatcher_type
    if d in IMPLEMENTED["token_dispatchers"]:
        return []
    return [_unsupported({"moe.token_dispatcher_type": d}, f"the {d!r} token dispatcher",
                         "set moe.token_dispatcher_type=alltoall")]


@rule("unsupported.token_dropping", "capacity factor (token dropping); gptoss routes dropless", kind=UNSUPPORTED)
def unsupported_dropping(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    cf = cfg.moe.capacity_factor
    if cf is None:
        return []
    return [_unsupported({"moe.capacity_factor": cf}, "token dropping (capacity_factor)",
                         "set moe.capacity_factor=null (dropless)")]


@rule("unsupported.router_dtype", "a router dtype other than the params dtype", kind=UNSUPPORTED)
def unsupported_router_dtype(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    dt = cfg.moe.router_dtype
    if dt is None:
        return []
    return [_unsupported({"moe.router_dtype": dt}, f"computing the router in {dt}",
                         "set moe.router_dtype=null (the router runs in the params dtype)")]


@rule("unsupported.fp16", "fp16 parameters (they need dynamic loss scaling)", kind=UNSUPPORTED)
def unsupported_fp16(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if cfg.precision.params_dtype != "fp16":
        return []
    return [_unsupported({"precision.params_dtype": "fp16"}, "fp16 training (dynamic loss scaling)",
                         "set precision.params_dtype=bf16")]


@rule("unsupported.fp8", "FP8 recipes gptoss train does not implement", kind=UNSUPPORTED)
def unsupported_fp8(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    r = cfg.precision.fp8_recipe
    if r in IMPLEMENTED["fp8_recipes"]:
        return []
    return [_unsupported({"precision.fp8_recipe": r}, f"FP8 recipe {r!r}", "set precision.fp8_recipe=none")]


@rule("unsupported.cuda_graphs", "CUDA graphs and the paged stash", kind=UNSUPPORTED)
def unsupported_graphs(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    g = cfg.cuda_graphs
    if g.cuda_graph_impl == "none" and not g.paged_stash:
        return []
    return [_unsupported({"cuda_graphs.cuda_graph_impl": g.cuda_graph_impl, "cuda_graphs.paged_stash": g.paged_stash},
                         "CUDA graph capture", "set cuda_graphs.cuda_graph_impl=none cuda_graphs.paged_stash=false")]


@rule("unsupported.recompute", "activation recompute", kind=UNSUPPORTED)
def unsupported_recompute(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    g = cfg.recompute.recompute_granularity
    if g == "none":
        return []
    return [_unsupported({"recompute.recompute_granularity": g}, "activation recompute",
                         "set recompute.recompute_granularity=none")]


@rule("unsupported.grad_overlap", "overlap_grad_reduce / overlap_param_gather", kind=UNSUPPORTED)
def unsupported_grad_overlap(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    ov = cfg.overlap
    if not ov.overlap_grad_reduce and not ov.overlap_param_gather:
        return []
    return [_unsupported({"overlap.overlap_grad_reduce": ov.overlap_grad_reduce,
                          "overlap.overlap_param_gather": ov.overlap_param_gather},
                         "overlapping gradient reduction / parameter gather",
                         "set overlap.overlap_grad_reduce=false overlap.overlap_param_gather=false")]


@rule("unsupported.checkpoint_format", "checkpoint formats other than gptoss's own", kind=UNSUPPORTED)
def unsupported_ckpt_format(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    f = cfg.checkpoint.format
    if f in IMPLEMENTED["checkpoint_formats"]:
        return []
    return [_unsupported({"checkpoint.format": f}, f"the {f!r} checkpoint format", "set checkpoint.format=gptoss")]


# --- helpers ---------------------------------------------------------------------------------------
def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _short_pattern(text: str) -> str:
    """'*E*E...*E' (72 chars) shown as "'*E' x 36"; anything else up to 40 characters."""
    compact = "".join(text.split())
    if len(compact) >= 4 and len(compact) % 2 == 0 and compact == compact[:2] * (len(compact) // 2):
        return f"{compact[:2]!r} x {len(compact) // 2}"
    return compact if len(compact) <= 40 else compact[:37] + "..."


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


__all__ = [
    "Finding", "Rule", "Context", "RULES", "rule", "list_rules", "error", "warning", "IMPLEMENTED",
    "schedule_plan_support", "schedule_plan_capability", "default_model_class", "resolve_world_size",
    "data_parallel_size", "expert_data_parallel_size", "gpu_from_device_name", "ERROR", "WARNING", "SEMANTIC", "UNSUPPORTED",
]
