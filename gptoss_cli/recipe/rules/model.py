"""The model: the layer pattern, MTP layers and sequence length against the architecture; the attention kernel."""

from __future__ import annotations

from gptoss_cli.model.pattern import ATTENTION, MOE
from gptoss_cli.recipe.rules.core import (ERROR, WARNING, Context, Finding, error, rule, short_pattern, version_tuple,
                                          warning)
from gptoss_cli.recipe.schema import RecipeConfig


# --- the model -------------------------------------------------------------------------------
@rule("model.pattern_matches_architecture",
      "hybrid_layer_pattern is one '*E' pair per HF block (attention then MoE), as the weights map",
      fix="set model.hybrid_layer_pattern=null (derived from the architecture) or change "
          "model.architecture.num_hidden_layers")
def pattern_matches_architecture(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    expected = (ATTENTION, MOE) * ctx.arch.num_hidden_layers
    if ctx.pattern.layers == expected:
        return []
    return [error(
        {"model.hybrid_layer_pattern": short_pattern(ctx.pattern.text),
         "model.num_hidden_layers": ctx.arch.num_hidden_layers},
        f"pattern has layers {short_pattern(''.join(ctx.pattern.layers))} but GPT-OSS with "
        f"{ctx.arch.num_hidden_layers} blocks needs '*E' x {ctx.arch.num_hidden_layers} "
        "(HF block i -> attention layer 2i, MoE layer 2i+1)",
    )]


@rule("model.mtp_layers", "mtp_num_layers > 0 needs a model with MTP layers; GPT-OSS has none",
      fix="set model.mtp_num_layers=0 (or null)")
def mtp_layers(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    n = cfg.model.mtp_num_layers
    if n is None or n <= 0:
        return []
    return [error({"model.mtp_num_layers": n},
                  f"mtp_num_layers={n} asks for multi-token-prediction layers, which GPT-OSS does not have")]


@rule("model.seq_within_positions", "training.seq_length <= the model's max_position_embeddings",
      fix="training.seq_length <= the model's max_position_embeddings")
def seq_within_positions(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    seq, cap = cfg.training.seq_length, ctx.arch.max_position_embeddings
    if seq <= cap:
        return []
    return [error({"training.seq_length": seq, "max_position_embeddings": cap},
                  f"seq_length={seq} exceeds the model's max_position_embeddings={cap}",
                  f"set training.seq_length <= {cap}")]


# --- attention kernels (model/attention/backends.py) -----------------------------------------------
@rule("model.attention_backend",
      "attention_backend flash on CUDA needs layers without a sliding window (the CUDA flash kernel takes "
      "no mask); flex needs torch >= 2.5",
      fix="model.attention_backend=auto (flash where it applies, FlexAttention on sliding-window layers) or flex "
          "or sdpa; for flex, torch 2.5 or newer",
      severities=(ERROR, WARNING))
def attention_backend(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    backend, a = cfg.model.attention_backend, ctx.arch
    fields = {"model.attention_backend": backend, "system.device": cfg.system.device}
    if backend == "flex" and ctx.torch_version and version_tuple(ctx.torch_version) < (2, 5):
        return [error({**fields, "torch": ctx.torch_version},
                      f"FlexAttention needs torch >= 2.5, this environment has {ctx.torch_version}")]
    sliding = a.sliding_window < cfg.training.seq_length and any(a.is_sliding(i) for i in range(a.num_hidden_layers))
    if backend != "flash" or not sliding or cfg.system.device == "cpu":
        return []
    what = (f"sliding-window layers (window {a.sliding_window} < seq_length {cfg.training.seq_length}) need a mask, "
            "which the CUDA flash kernel does not take")
    if cfg.system.device == "auto":
        return [warning(fields, f"{what}: flash fails there if this runs on CUDA")]
    return [error(fields, what)]
