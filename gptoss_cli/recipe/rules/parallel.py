"""Parallel arithmetic and MoE settings: sizes divide, batches split, pipeline stages fit."""

from __future__ import annotations

import math

from gptoss_cli.errors import ConfigError
from gptoss_cli.schedule.pipeline.layout import pipeline_layout, schedule_problems
from gptoss_cli.recipe.rules.core import ERROR, WARNING, Context, Finding, error, rule, short_pattern, warning
from gptoss_cli.recipe.schema import RecipeConfig
from gptoss_cli.recipe.estimate.sizes import data_parallel_size, expert_model_parallel_product, model_parallel_size


# --- parallel arithmetic -----------------------------------------------------------------------
@rule("parallel.world_size_consistent",
      "world size from --world-size, parallelism.world_size and nodes x gpus_per_node agree",
      fix="make --world-size, parallelism.world_size and nodes x gpus_per_node agree, or drop "
          "parallelism.world_size; a different --world-size is a warning",
      severities=(ERROR, WARNING))
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


@rule("parallel.world_divisible", "world size divisible by TP x PP x CP (the rest is data parallel)",
      fix="a world size that is a multiple of TP x PP x CP, or smaller model-parallel sizes")
def world_divisible(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    p = cfg.parallelism
    return _world_divisible_by(
        ctx, model_parallel_size(cfg), "TP x PP x CP",
        {"parallelism.tensor_model_parallel_size": p.tensor_model_parallel_size,
         "parallelism.pipeline_model_parallel_size": p.pipeline_model_parallel_size,
         "parallelism.context_parallel_size": p.context_parallel_size},
        "smaller model-parallel sizes")


@rule("parallel.expert_world_divisible",
      "world size divisible by ETP x EP x PP (the rest is expert data parallel)",
      fix="a world size that is a multiple of ETP x EP x PP, or a smaller expert_model_parallel_size")
def expert_world_divisible(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    p = cfg.parallelism
    return _world_divisible_by(
        ctx, expert_model_parallel_product(cfg), "ETP x EP x PP",
        {"parallelism.expert_model_parallel_size": p.expert_model_parallel_size,
         "parallelism.expert_tensor_parallel_size": p.expert_tensor_parallel_size,
         "parallelism.pipeline_model_parallel_size": p.pipeline_model_parallel_size},
        "a smaller expert_model_parallel_size")


def _world_divisible_by(ctx: Context, product: int, label: str, sizes: dict[str, int], smaller: str) -> list[Finding]:
    """No finding when the world size is a multiple of `product` (the sizes `label` names, e.g. "TP x PP x CP");
    else one error showing the world size and `sizes`, whose fix is a multiple of `product` or `smaller`."""
    if ctx.world_size % product == 0:
        return []
    return [error({"world_size": ctx.world_size, **sizes},
                  f"world size {ctx.world_size} is not divisible by {label} = {product}",
                  f"use a world size that is a multiple of {product}, or {smaller}")]


@rule("parallel.data_parallel_consistent", "an explicit data_parallel_size equals world / (TP x PP x CP)",
      fix="set parallelism.data_parallel_size=null to derive it, or change the world size")
def data_parallel_consistent(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    want = cfg.parallelism.data_parallel_size
    dp = data_parallel_size(cfg, ctx.world_size)
    if want is None or dp is None or want == dp:
        return []
    return [error({"parallelism.data_parallel_size": want, "world_size": ctx.world_size},
                  f"data_parallel_size={want} but world size {ctx.world_size} / (TP x PP x CP) = {dp}")]


@rule("parallel.experts_divisible", "num_local_experts divisible by expert_model_parallel_size",
      fix="an expert_model_parallel_size that divides num_local_experts (32 for 20B, 128 for 120B)")
def experts_divisible(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    ep, experts = cfg.parallelism.expert_model_parallel_size, ctx.arch.num_local_experts
    if experts % ep == 0:
        return []
    return [error({"parallelism.expert_model_parallel_size": ep, "num_local_experts": experts},
                  f"{experts} experts cannot be split evenly over EP={ep}",
                  f"use an expert_model_parallel_size that divides {experts}")]


@rule("parallel.heads_divisible", "attention heads and kv heads divisible by tensor_model_parallel_size",
      fix="a tensor_model_parallel_size that divides both head counts")
def heads_divisible(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    tp, a = cfg.parallelism.tensor_model_parallel_size, ctx.arch
    bad = {k: v for k, v in (("num_attention_heads", a.num_attention_heads),
                             ("num_key_value_heads", a.num_key_value_heads)) if v % tp}
    if not bad:
        return []
    return [error({"parallelism.tensor_model_parallel_size": tp, **bad},
                  f"TP={tp} does not divide {', '.join(f'{k}={v}' for k, v in bad.items())}",
                  f"use a tensor_model_parallel_size that divides {math.gcd(a.num_attention_heads, a.num_key_value_heads)}")]


@rule("parallel.batch_divisible", "global_batch_size divisible by micro_batch_size x data parallel size",
      fix="training.global_batch_size a multiple of micro_batch_size x DP")
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


def microbatches_per_step(cfg: RecipeConfig, world_size: int) -> int | None:
    """Microbatches each data-parallel stream runs per step: GBS / (MBS x world / (TP x PP x CP))."""
    dp = data_parallel_size(cfg, world_size)
    step = cfg.training.micro_batch_size * dp if dp else 0
    return cfg.training.global_batch_size // step if step and cfg.training.global_batch_size % step == 0 else None


def _pipeline_fields(cfg: RecipeConfig) -> dict:
    p = cfg.parallelism
    return {"parallelism.pipeline_model_parallel_size": p.pipeline_model_parallel_size,
            "parallelism.virtual_pipeline_model_parallel_size": p.virtual_pipeline_model_parallel_size,
            "parallelism.pipeline_schedule": p.pipeline_schedule,
            "parallelism.pipeline_model_parallel_layout": p.pipeline_model_parallel_layout}


@rule("parallel.pipeline_layout",
      "pipeline stages: the layout (parallelism.pipeline_model_parallel_layout, or '|' in the pattern) places "
      "every decoder block on PP x VPP stages and cuts only between blocks (`*E` stays whole), the embedding "
      "first and the loss last; without one the blocks divide evenly; every pipeline rank holds something; "
      "VPP needs PP > 1",
      fix="set parallelism.pipeline_model_parallel_layout (Megatron's grammar: E, t per block, L, |), or change "
          "PP/VPP; VPP and a layout need PP > 1")
def pipeline_layout_rule(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    p, out = cfg.parallelism, []
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    fields = _pipeline_fields(cfg)
    if pp == 1:
        if vpp is not None:
            out.append(error(fields, "virtual pipeline stages need pipeline parallelism (PP > 1)",
                             "set parallelism.virtual_pipeline_model_parallel_size=null"))
        if p.pipeline_model_parallel_layout or ctx.pattern.pipeline_splits:
            out.append(error({**fields, "model.hybrid_layer_pattern": short_pattern(ctx.pattern.text)},
                             "a pipeline layout (or '|' in the pattern) needs pipeline parallelism (PP > 1)",
                             "set parallelism.pipeline_model_parallel_layout=null and no '|' in the pattern, or PP > 1"))
        return out
    try:
        layout = pipeline_layout(ctx.pattern, pp, vpp, p.pipeline_schedule, p.pipeline_model_parallel_layout)
    except ConfigError as exc:
        return [error({**fields, "model.hybrid_layer_pattern": short_pattern(ctx.pattern.text)}, exc.message,
                      exc.hint)]
    empty = [r for r in range(pp) if not layout.rank_layers(r)
             and not any(s.embedding or s.loss for s in layout.rank_stages(r))]
    if empty:
        out.append(error(fields, f"pipeline ranks {empty} hold no layer, embedding or output layer "
                                 f"(layout {layout.text()!r}): nothing to train there",
                         "give every pipeline rank at least one decoder block"))
    return out


@rule("parallel.pipeline_schedule",
      "the pipeline schedule fits PP, VPP and the microbatches per step (torch.distributed.pipelining's "
      "requirements: 1f1b one stage per rank and >= PP microbatches; interleaved_1f1b VPP >= 2; zbv_zero_bubble "
      "and dualpipev VPP = 2, dualpipev >= 2 x PP microbatches); a schedule without PP is ignored (a warning)",
      fix="choose parallelism.pipeline_schedule for the VPP, or change VPP or the global batch size",
      severities=(ERROR, WARNING))
def pipeline_schedule_rule(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    p = cfg.parallelism
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    if pp == 1:
        if p.pipeline_schedule != "1f1b":
            return [warning(_pipeline_fields(cfg), f"pipeline_schedule={p.pipeline_schedule} has no effect "
                                                   "without pipeline parallelism", "set parallelism.pipeline_schedule=1f1b")]
        return []
    m = microbatches_per_step(cfg, ctx.world_size)
    return [error({**_pipeline_fields(cfg), "microbatches_per_step": m}, what, fix)
            for what, fix in schedule_problems(p.pipeline_schedule, pp, vpp, m)]


@rule("parallel.context_parallel_seq",
      "with CP > 1, seq_length divisible by CP (one contiguous slice per rank); by 2 x CP for Megatron's "
      "load-balanced ring attention (a warning)",
      fix="training.seq_length a multiple of CP (of 2 x CP for Megatron)", severities=(ERROR, WARNING))
def context_parallel_seq(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    cp, seq = cfg.parallelism.context_parallel_size, cfg.training.seq_length
    fields = {"parallelism.context_parallel_size": cp, "training.seq_length": seq}
    if cp == 1 or seq % (2 * cp) == 0:
        return []
    if seq % cp:
        return [error(fields, f"seq_length={seq} is not divisible by CP={cp}: every CP rank holds an equal "
                              f"slice of each sequence", f"use a seq_length that is a multiple of {cp}")]
    return [warning(fields, f"seq_length={seq} is not divisible by 2 x CP = {2 * cp}: fine for gptoss's all-to-all "
                            "CP, but Megatron's load-balanced ring attention cuts each sequence into 2 x CP chunks",
                    f"for a Megatron run use a seq_length that is a multiple of {2 * cp}")]


@rule("parallel.context_parallel_heads",
      "with CP > 1, attention heads and kv heads divisible by CP (all-to-all CP gives each rank whole "
      "kv heads, so CP <= kv heads: 8 for GPT-OSS)",
      fix="a context_parallel_size that divides both head counts")
def context_parallel_heads(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    cp, a = cfg.parallelism.context_parallel_size, ctx.arch
    bad = {k: v for k, v in (("num_attention_heads", a.num_attention_heads),
                             ("num_key_value_heads", a.num_key_value_heads)) if v % cp}
    if cp == 1 or not bad:
        return []
    return [error({"parallelism.context_parallel_size": cp, **bad},
                  f"CP={cp} does not divide {', '.join(f'{k}={v}' for k, v in bad.items())}: all-to-all "
                  "(Ulysses) context parallelism gives each rank whole heads (ring attention, which would "
                  "allow more, is not implemented)",
                  f"use a context_parallel_size that divides {math.gcd(a.num_attention_heads, a.num_key_value_heads)}")]


@rule("parallel.context_parallel_combinations",
      "CP > 1 does not combine yet with the load-balancing aux loss or the EP A2A overlap schedule",
      fix="with CP > 1: moe.aux_loss_coeff=0 and overlap.overlap_moe_expert_parallel_comm=false")
def context_parallel_combinations(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    cp = cfg.parallelism.context_parallel_size
    if cp == 1:
        return []
    out = []
    if cfg.moe.aux_loss_coeff > 0:
        out.append(error({"parallelism.context_parallel_size": cp, "moe.aux_loss_coeff": cfg.moe.aux_loss_coeff},
                         "the load-balancing aux loss under CP would be computed from each rank's slice of the "
                         "sequence, not from the whole sequence (not implemented)",
                         "set moe.aux_loss_coeff=0 (or context_parallel_size=1)"))
    if cfg.overlap.overlap_moe_expert_parallel_comm:
        out.append(error({"parallelism.context_parallel_size": cp, "overlap.overlap_moe_expert_parallel_comm": True},
                         "the combined-1F1B EP A2A overlap schedule is not verified with CP's attention all-to-all",
                         "set overlap.overlap_moe_expert_parallel_comm=false (or context_parallel_size=1)"))
    return out


@rule("parallel.sequence_parallel", "sequence_parallel needs TP > 1 and seq_length divisible by TP",
      fix="with TP=1 (a warning): parallelism.sequence_parallel=false; with TP > 1: a seq_length divisible "
          "by TP",
      severities=(ERROR, WARNING))
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


@rule("moe.sequence_parallel_with_tp", "expert parallelism together with TP > 1 requires sequence_parallel",
      fix="set parallelism.sequence_parallel=true")
def moe_sequence_parallel(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    p = cfg.parallelism
    if p.expert_model_parallel_size > 1 and p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
        return [error({"parallelism.expert_model_parallel_size": p.expert_model_parallel_size,
                       "parallelism.tensor_model_parallel_size": p.tensor_model_parallel_size,
                       "parallelism.sequence_parallel": False},
                      "MoE with EP > 1 and TP > 1 needs sequence parallelism (Megatron's requirement)")]
    return []


@rule("moe.capacity_factor", "capacity_factor, when set, is > 0",
      fix="set moe.capacity_factor=null for dropless routing, or a value > 0")
def capacity_factor(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    cf = cfg.moe.capacity_factor
    if cf is None or cf > 0:
        return []
    return [error({"moe.capacity_factor": cf}, f"capacity_factor={cf} would drop every token")]


@rule("moe.shared_expert_overlap", "shared_expert_overlap needs shared experts; GPT-OSS has none",
      fix="set moe.shared_expert_overlap=false")
def shared_expert_overlap_needs_shared(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not cfg.moe.shared_expert_overlap:
        return []
    return [error({"moe.shared_expert_overlap": True}, "GPT-OSS has no shared experts to overlap")]


# The load-balancing loss is E * sum_e f_e * P_e (docs/architecture.md, "Aux loss"): about top_k at
# perfect balance (4 for GPT-OSS), more when routing collapses. Megatron-Bridge trains GPT-OSS with no
# load-balancing loss (its bridge sets moe_router_load_balancing_type="none"); Megatron's MoE recipes
# use coefficients of 1e-3 to 1e-2. The release's config.json carries router_aux_loss_coef=0.9,
# transformers' default, which only applies with output_router_logits=True: copied into training,
# 0.9 x 4 = 3.6 is added to a fine-tune's loss of about 1-2 and the router gradient is mostly aux.
AUX_LOSS_COEFF_WARN = 0.1


@rule("moe.router_loss_scale",
      f"moe.aux_loss_coeff above {AUX_LOSS_COEFF_WARN} (Megatron-Bridge's GPT-OSS: none; Megatron recipes: "
      "1e-3..1e-2; the release's config.json router_aux_loss_coef=0.9 is transformers' default), and router "
      "losses with a frozen router",
      fix="moe.aux_loss_coeff=1e-3 (or 0 for fine-tunes), and no aux/z-loss with moe.freeze_router=true",
      severities=(WARNING,))
def router_loss_scale(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    moe, out = cfg.moe, []
    if moe.aux_loss_coeff > AUX_LOSS_COEFF_WARN:
        k = ctx.arch.num_experts_per_tok
        out.append(warning(
            {"moe.aux_loss_coeff": moe.aux_loss_coeff},
            f"aux_loss_coeff={moe.aux_loss_coeff:g} adds about {moe.aux_loss_coeff * k:.2g} to the loss even at "
            f"perfect balance (the aux loss is about top_k={k} then), far above Megatron's 1e-3..1e-2; "
            "Megatron-Bridge trains GPT-OSS with no aux loss, and the release's router_aux_loss_coef=0.9 "
            "is transformers' default, not a training setting",
            "set moe.aux_loss_coeff=1e-3, or 0 for a fine-tune"))
    if moe.freeze_router and (moe.aux_loss_coeff > 0 or moe.z_loss_coeff > 0):
        out.append(warning(
            {"moe.freeze_router": True, "moe.aux_loss_coeff": moe.aux_loss_coeff, "moe.z_loss_coeff": moe.z_loss_coeff},
            "the router is frozen, so the aux and z-losses cannot move it; their gradient only reaches the "
            "layers below each router",
            "set moe.aux_loss_coeff=0 moe.z_loss_coeff=0 with moe.freeze_router=true"))
    return out
