"""FP8 and MXFP8: block divisibility, native kernels by GPU generation, emulation."""

from __future__ import annotations

from gptoss_cli.fp8.catalog import RECIPES as FP8_RECIPES
from gptoss_cli.recipe.environment import BLACKWELL, HOPPER_OR_NEWER
from gptoss_cli.recipe.rules.core import ERROR, WARNING, Context, Finding, error, rule, warning
from gptoss_cli.recipe.schema import RecipeConfig


# --- FP8 -----------------------------------------------------------------------------------------
@rule("fp8.mxfp8_dims", "MXFP8 needs every GEMM dimension divisible by 32 (one scale per 32 values)",
      fix="use precision.fp8_recipe=tensorwise or rowwise, or dimensions divisible by 32")
def mxfp8_dims(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if cfg.precision.fp8_recipe != "mxfp8":
        return []
    a = ctx.arch
    dims = {"hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
            "num_attention_heads x head_dim": a.num_attention_heads * a.head_dim, "qkv rows": a.qkv_rows}
    return _blocks_of_32({"precision.fp8_recipe": "mxfp8"}, dims, "MXFP8 scales blocks of 32 values")


def _blocks_of_32(setting: dict[str, str], dims: dict[str, int], what: str) -> list[Finding]:
    """One error naming every dimension in `dims` that is not a multiple of 32 (none: no finding)."""
    bad = {k: v for k, v in dims.items() if v % 32}
    if not bad:
        return []
    return [error({**setting, **bad}, f"{what}, but {', '.join(f'{k}={v}' for k, v in bad.items())} "
                                      "is not a multiple of 32")]


# The GPUs of each generation a recipe's native kernel needs (fp8/catalog.py), and how the rule names them.
_NATIVE_GPUS = {"Hopper": (HOPPER_OR_NEWER, "Hopper or newer (h100/h200/b200/gb200/gb300)"),
                "Blackwell": (BLACKWELL, "Blackwell (b200/gb200/gb300)")}


@rule("fp8.native_gpu",
      "FP8 needs a GPU with native kernels (Hopper+; MXFP8: Blackwell) unless fp8_emulation is set",
      fix="a GPU with native kernels, precision.fp8_emulation=true for numerics-only runs (a warning), or "
          "precision.fp8_recipe=none; system.gpu=auto is a warning until launch",
      severities=(ERROR, WARNING))
def fp8_native_gpu(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    recipe = cfg.precision.fp8_recipe
    if recipe not in FP8_RECIPES:  # "none" (any other value is the schema's to refuse)
        return []
    need, need_name = _NATIVE_GPUS[FP8_RECIPES[recipe].generation]
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


@rule("fp8.mxfp8_expert_bias", "warn: MXFP8 with GPT-OSS's biased experts has produced NaN in a peer",
      fix="none needed; watch the first steps' loss and grad norm against a bf16 run", severities=(WARNING,))
def mxfp8_expert_bias(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if cfg.precision.fp8_recipe != "mxfp8":
        return []
    # docs/megatron-rules.md, "FP8 and MXFP8": biased expert outputs saturated the scale in the backward
    # re-quantization.
    return [warning({"precision.fp8_recipe": "mxfp8"},
                    "GPT-OSS experts carry biases; a peer's MXFP8 grouped GEMM went NaN from step 1 "
                    "(scale saturation in the backward re-quantization)",
                    "watch the first steps' loss and grad norm; compare against a bf16 run (gptoss rounds MX "
                    "scales up, so a block maximum never saturates, and adds expert biases outside the GEMM)")]


# --- MXFP4 QAT (docs/qat.md) ---------------------------------------------------------------------
@rule("qat.mxfp4_dims", "MXFP4 QAT needs hidden_size and intermediate_size divisible by 32 (one scale per 32 values)",
      fix="precision.qat=none, or a model whose hidden_size and intermediate_size are multiples of 32")
def qat_mxfp4_dims(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if cfg.precision.qat != "mxfp4":
        return []
    a = ctx.arch
    return _blocks_of_32({"precision.qat": "mxfp4"}, {"hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size},
                         "MXFP4 scales blocks of 32 values along each expert GEMM's input")


@rule("qat.fp8_recipe", "MXFP4 QAT runs with fp8_recipe none (bf16/fp32 GEMMs) or mxfp8, not tensorwise or rowwise",
      fix="precision.fp8_recipe=mxfp8 (the rounded weights enter the MXFP8 forward GEMM unchanged) or none")
def qat_fp8_recipe(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    p = cfg.precision
    spec = FP8_RECIPES.get(p.fp8_recipe)
    if p.qat != "mxfp4" or spec is None or spec.scaling == "mx":  # MX blocks keep the MXFP4 values exactly
        return []
    per = spec.scaling  # "tensor" or "row"
    return [error({"precision.qat": "mxfp4", "precision.fp8_recipe": p.fp8_recipe},
                  f"{p.fp8_recipe} FP8 re-rounds the MXFP4 weights with one scale per {per}, so the forward "
                  "would not compute with the weights the MXFP4 export writes")]
