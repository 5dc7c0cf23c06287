"""LoRA: targets that exist, rank bounds, a base to adapt, MXFP4 base experts, and what LoRA does not combine with yet.

The overlap schedule and delayed wgrad combine with LoRA (tests/train/test_lora_ep.py): the frozen
base queues no weight gradients, the expert adapters' wait in the queue. So do the FP8 recipes
(tests/fp8/test_lora_fp8.py): the frozen base's GEMMs in FP8, the adapters in the params dtype. So does
lora.base_experts=mxfp4 with all of them (gptoss_cli/model/mxfp4/experts.py): the GEMMs get the decoded
weight, FP8 quantises it as it would a bf16 base's, QAT rounds it with the adapters merged in."""

from __future__ import annotations

from gptoss_cli.model.catalog import MLP_TARGETS
from gptoss_cli.model.pattern import MLP, MOE
from gptoss_cli.recipe.rules.core import Context, Finding, error, rule
from gptoss_cli.recipe.schema import RecipeConfig


@rule("lora.targets", "a LoRA rank needs targets; every target exists in the layer pattern, once "
      "(targets with lora.rank=0 are refused when the recipe loads, exit 2)",
      fix="lora.target_modules from linear_qkv, linear_proj, linear_fc1, linear_fc2, each once, that the layer "
          "pattern has")
def lora_targets(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    lo = cfg.lora
    targets = list(lo.target_modules)
    if lo.rank == 0:  # off (with targets it never loads: LoraConfig.pairing_problems)
        return []
    if not targets:
        return [error({"lora.rank": lo.rank, "lora.target_modules": []},
                      f"lora.rank={lo.rank} but lora.target_modules is empty: nothing would train",
                      "set lora.target_modules, e.g. [linear_qkv, linear_proj, linear_fc1, linear_fc2]")]
    out = []
    if len(set(targets)) != len(targets):
        out.append(error({"lora.target_modules": targets}, f"lora.target_modules={targets} names a layer twice",
                         "list each target once"))
    if not any(s in (MOE, MLP) for s in ctx.pattern.layers):
        for t in targets:
            if t in MLP_TARGETS:
                out.append(error({"lora.target_modules": targets},
                                 f"lora.target_modules: {t} matches no layer (the pattern "
                                 f"{ctx.pattern.text!r} has no MoE or MLP layer)", f"drop {t}"))
    return out


@rule("lora.rank", "1 <= lora.rank <= the smallest width it adapts; dropout < 1",
      fix="lora.rank between 1 and min(hidden_size, intermediate_size); typical: 8 to 64")
def lora_rank(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    lo, a = cfg.lora, ctx.arch
    out = []
    if lo.rank > 0:
        widest = min(a.hidden_size, a.intermediate_size, a.num_attention_heads * a.head_dim)
        if lo.rank > widest:
            out.append(error({"lora.rank": lo.rank},
                             f"lora.rank={lo.rank} exceeds {widest}, the smallest width an adapter spans; "
                             "a low-rank update that is not low-rank trains more than full fine-tuning would"))
    if lo.dropout >= 1.0:
        out.append(error({"lora.dropout": lo.dropout}, f"lora.dropout={lo.dropout} drops every input",
                         "set lora.dropout in [0, 1), usually 0"))
    return out


@rule("lora.base", "LoRA adapts a pretrained base (checkpoint.pretrained)",
      fix="set checkpoint.pretrained to a `gptoss convert` output (or an HF folder)")
def lora_base(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if cfg.lora.rank == 0 or cfg.checkpoint.pretrained:
        return []
    return [error({"lora.rank": cfg.lora.rank, "checkpoint.pretrained": None},
                  "LoRA trains adapters on a frozen base, but checkpoint.pretrained is not set (the base would be "
                  "a random initialisation)")]


@rule("lora.base_experts", "lora.base_experts=mxfp4 keeps a LoRA run's frozen experts as MXFP4 blocks/scales: it "
      "needs LoRA on and hidden_size, intermediate_size divisible by 32 (one scale per 32 inputs)",
      fix="lora.base_experts=bf16, or a lora.rank with a model whose hidden_size and intermediate_size are multiples of 32")
def lora_base_experts(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    lo = cfg.lora
    if lo.base_experts != "mxfp4":
        return []
    if lo.rank == 0:
        return [error({"lora.base_experts": "mxfp4", "lora.rank": 0},
                      "lora.base_experts=mxfp4 keeps the experts frozen in MXFP4, but lora.rank=0 is a full "
                      "fine-tune, which trains them", "set lora.base_experts=bf16, or a lora.rank")]
    a = ctx.arch
    bad = {k: v for k, v in (("hidden_size", a.hidden_size), ("intermediate_size", a.intermediate_size)) if v % 32}
    if not bad:
        return []
    return [error({"lora.base_experts": "mxfp4", **bad},
                  "MXFP4 scales blocks of 32 values along each expert GEMM's input, but "
                  f"{', '.join(f'{k}={v}' for k, v in bad.items())} is not a multiple of 32")]


@rule("lora.combinations", "what LoRA does not combine with yet: context parallelism",
      fix="parallelism.context_parallel_size=1")
def lora_combinations(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    lo = cfg.lora
    if lo.rank == 0:
        return []
    out = []
    cp = cfg.parallelism.context_parallel_size
    if cp > 1:
        # the adapters' gradient reduction over DP x CP has no test yet: refuse rather than risk it
        out.append(error({"parallelism.context_parallel_size": cp},
                         f"LoRA with parallelism.context_parallel_size={cp} is not supported yet (its adapter "
                         "gradients under CP are untested)", "set parallelism.context_parallel_size=1"))
    return out
