"""The architecture as Megatron records it: `args` in common.pt (Megatron-LM), `model:` in run_config.yaml
(Megatron-Bridge), and the `args` `convert --to megatron` writes. Torch-free.

Reading: every field comes from `args`, else from Megatron-Bridge's `run_config.yaml` beside the
weights (its `model:` section names the same fields, except `num_moe_experts`, `seq_length` for the
position limit and `layernorm_epsilon`). The sliding windows (`window_size`, `window_attn_skip_freq`)
and the position limit (`max_position_embeddings`) change what the network computes and have no
safe default: when neither file records them the read stops with one line naming the field, unless
the architecture is taken from elsewhere (`arch_from`: an HF config.json or a preset), which then
also supplies every other field the files lack and must agree with those they state.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gptoss_cli.checkpoint.formats.megatron.names import BACKEND, RUN_CONFIG, padded_vocab
from gptoss_cli.errors import CheckpointError, ConfigError, first_line
from gptoss_cli.model.config import FULL, SLIDING, GptOssArch

# run_config.yaml's `model:` names (Megatron-Bridge's TransformerConfig) -> Megatron-LM's args names
_BRIDGE_NAMES = {"num_moe_experts": "num_experts", "seq_length": "max_position_embeddings",
                 "layernorm_epsilon": "norm_epsilon"}
# Fields without which the architecture is unknown (no default is safe): what `arch_from` supplies
WINDOW_FIELDS = ("window_size", "window_attn_skip_freq")
POSITION_FIELD = "max_position_embeddings"
ARCH_FROM_HINT = ("take the architecture from the model's HF config.json or a preset: "
                  "convert ... --arch-from path/to/config.json (or --arch-from gpt_oss_20b)")


def megatron_args(arch: GptOssArch, *, vocab_multiple: int, params_dtype: Any) -> argparse.Namespace:
    """The `args` Megatron-LM checks on load (and `--use-checkpoint-args` copies) for this model."""
    import torch  # noqa: PLC0415 (the writer's side: params_dtype is a torch dtype)

    window = [0] * arch.num_hybrid_layers  # Megatron's per-layer list: 1 = sliding window at layer i+1
    for b in range(arch.num_hidden_layers):
        window[2 * b] = int(arch.is_sliding(b))
    return argparse.Namespace(
        num_layers=arch.num_hybrid_layers, hybrid_override_pattern=arch.hybrid_layer_pattern, is_hybrid_model=True,
        hidden_size=arch.hidden_size, ffn_hidden_size=arch.intermediate_size, moe_ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads, group_query_attention=True,
        num_query_groups=arch.num_key_value_heads, kv_channels=arch.head_dim,
        num_experts=arch.num_local_experts, moe_router_topk=arch.num_experts_per_tok, moe_grouped_gemm=True,
        moe_aux_loss_coeff=arch.router_aux_loss_coef,
        vocab_size=arch.vocab_size, padded_vocab_size=padded_vocab(arch.vocab_size, vocab_multiple),
        make_vocab_size_divisible_by=vocab_multiple,
        max_position_embeddings=arch.max_position_embeddings, position_embedding_type="yarn",
        add_position_embedding=False, rotary_base=arch.rope_theta,
        yarn_rotary_scaling_factor=arch.rope_scaling_factor,
        yarn_original_max_position_embeddings=arch.rope_original_max_position_embeddings,
        yarn_beta_fast=arch.rope_beta_fast, yarn_beta_slow=arch.rope_beta_slow,
        yarn_correction_range_round_to_int=arch.rope_truncate,
        normalization="RMSNorm", norm_epsilon=arch.rms_norm_eps,
        swiglu=True, activation_func_clamp_value=arch.swiglu_limit, glu_linear_offset=1.0,
        gptoss_swiglu_alpha=arch.swiglu_alpha,
        add_bias_linear=True, add_qkv_bias=True, softmax_type="learnable",
        window_size=(arch.sliding_window - 1, 0),  # Megatron counts the keys before the query
        window_attn_skip_freq=window,
        untie_embeddings_and_output_weights=True,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, fp16=False,
        init_method_std=arch.initializer_range, ckpt_format=BACKEND,
    )


class RecordedArgs:
    """The fields a Megatron checkpoint records: `args` first, then run_config.yaml's `model:`."""

    def __init__(self, args: Any, where: Path, run_config: dict | None = None, run_config_path: Path | None = None):
        self.args, self.where = args, where
        model = (run_config or {}).get("model") if isinstance(run_config, dict) else None
        self.bridge = {_BRIDGE_NAMES.get(k, k): v for k, v in model.items()} if isinstance(model, dict) else {}
        self.run_config_path = run_config_path

    def has(self, name: str) -> bool:
        """Whether either file records `name` at all (an explicit None counts: Megatron's "off")."""
        return (isinstance(self.args, argparse.Namespace) and hasattr(self.args, name)) or name in self.bridge

    def get(self, name: str, default: Any = None) -> Any:
        value = getattr(self.args, name, None) if isinstance(self.args, argparse.Namespace) else None
        if value is None:
            value = self.bridge.get(name)
        return default if value is None else value

    def missing(self, name: str, what: str) -> CheckpointError:
        also = f" nor {self.run_config_path}" if self.run_config_path else f" (and there is no {RUN_CONFIG} beside it)"
        return CheckpointError(f"{self.where}: args record no {name}{also}, so {what} is unknown", hint=ARCH_FROM_HINT)


def arch_from_args(recorded: RecordedArgs, arch_from: GptOssArch | None = None) -> GptOssArch:
    """The GptOssArch the recorded fields describe; CheckpointError naming the field otherwise.

    Fields Megatron does not record (token ids, swiglu alpha when not ours) keep GPT-OSS's values,
    or `arch_from`'s when given."""
    source = recorded.where
    try:
        arch = _arch_from_args(recorded, arch_from)
    except CheckpointError:
        raise
    except (TypeError, ValueError, IndexError, KeyError, AttributeError) as exc:  # e.g. a field of the wrong type
        raise CheckpointError(f"{source}: args describe no valid GPT-OSS architecture ({first_line(exc)})") from None
    if arch_from is not None and arch.differences(arch_from):
        raise _disagree(source, arch.differences(arch_from))
    return arch


def _disagree(source: Path, differences: list[str]) -> CheckpointError:
    return CheckpointError(f"{source}: the checkpoint's args and --arch-from disagree "
                           f"(args vs --arch-from: {'; '.join(differences[:3])})",
                           hint="--arch-from must describe the model the checkpoint holds")


def _windows(recorded: RecordedArgs, blocks: int, num_layers: int, arch_from: GptOssArch | None) -> tuple[int, list[str]]:
    """(sliding window, layer types) from window_size and window_attn_skip_freq (Megatron's rule)."""
    absent = [name for name in WINDOW_FIELDS if not recorded.has(name)]
    if absent:
        if arch_from is None:
            raise recorded.missing(absent[0], "which attention layers slide, and how far,")
        if arch_from.num_hidden_layers != blocks:
            raise _disagree(recorded.where, [f"num_hidden_layers: {blocks} vs {arch_from.num_hidden_layers}"])
        return arch_from.sliding_window, list(arch_from.layer_types)
    window, skip = recorded.get("window_size"), recorded.get("window_attn_skip_freq")
    if not window:  # recorded as None: Megatron computed full attention on every layer
        return (arch_from or GptOssArch()).sliding_window, [FULL] * blocks
    sliding = int(window[0]) + 1
    if isinstance(skip, list) and len(skip) == num_layers:
        return sliding, [SLIDING if skip[2 * b] else FULL for b in range(blocks)]
    if skip is None or isinstance(skip, int):  # Megatron's rule: layer n (1-based) slides iff n % freq
        return sliding, [SLIDING if skip is None or (2 * b + 1) % skip else FULL for b in range(blocks)]
    raise CheckpointError(f"{recorded.where}: args.window_attn_skip_freq {skip!r} is neither an int nor a list "
                          f"of {num_layers} entries")


def _arch_from_args(recorded: RecordedArgs, arch_from: GptOssArch | None) -> GptOssArch:
    source, get = recorded.where, recorded.get
    if not isinstance(recorded.args, argparse.Namespace) and not recorded.bridge:
        raise CheckpointError(f"{source}: 'args' is a {type(recorded.args).__name__}, not Megatron-LM's "
                              f"argparse.Namespace, and there is no {RUN_CONFIG} beside it", hint=ARCH_FROM_HINT)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_experts"):
        if not isinstance(get(name), int):
            raise CheckpointError(f"{source}: args.{name} is {get(name)!r}; not a GPT-OSS mixture-of-experts checkpoint")
    num_layers = get("num_layers")
    pattern = get("hybrid_override_pattern")
    if not isinstance(pattern, str) or pattern.replace("|", "") != "*E" * (num_layers // 2) or num_layers % 2:
        raise CheckpointError(
            f"{source}: args.hybrid_override_pattern is {pattern!r}; gptoss reads hybrid GPT-OSS checkpoints whose "
            f"pattern is '*E' per block ({num_layers} layers)")
    blocks = num_layers // 2
    sliding, layer_types = _windows(recorded, blocks, num_layers, arch_from)
    if get(POSITION_FIELD) is None and arch_from is None:
        raise recorded.missing(POSITION_FIELD, "the position limit (and YaRN's scaling with it)")
    vocab = get("vocab_size", get("padded_vocab_size"))
    if not isinstance(vocab, int):
        raise CheckpointError(f"{source}: args records neither vocab_size nor padded_vocab_size")
    d = arch_from or GptOssArch()
    fields = dict(
        num_hidden_layers=blocks, num_local_experts=get("num_experts"),
        num_experts_per_tok=get("moe_router_topk", d.num_experts_per_tok),
        hidden_size=get("hidden_size"), intermediate_size=get("moe_ffn_hidden_size", get("ffn_hidden_size")),
        num_attention_heads=get("num_attention_heads"),
        num_key_value_heads=get("num_query_groups", get("num_attention_heads")),
        head_dim=get("kv_channels", get("hidden_size") // get("num_attention_heads")),
        vocab_size=vocab, sliding_window=sliding, layer_types=layer_types,
        max_position_embeddings=get(POSITION_FIELD, d.max_position_embeddings),
        rms_norm_eps=get("norm_epsilon", d.rms_norm_eps), rope_theta=get("rotary_base", d.rope_theta),
        rope_scaling_factor=get("yarn_rotary_scaling_factor", d.rope_scaling_factor),
        rope_beta_fast=get("yarn_beta_fast", d.rope_beta_fast), rope_beta_slow=get("yarn_beta_slow", d.rope_beta_slow),
        rope_original_max_position_embeddings=get("yarn_original_max_position_embeddings",
                                                  d.rope_original_max_position_embeddings),
        rope_truncate=bool(get("yarn_correction_range_round_to_int", d.rope_truncate if arch_from else False)),
        swiglu_limit=get("activation_func_clamp_value", d.swiglu_limit),
        swiglu_alpha=get("gptoss_swiglu_alpha", d.swiglu_alpha),
        router_aux_loss_coef=get("moe_aux_loss_coeff", d.router_aux_loss_coef),
        initializer_range=get("init_method_std", d.initializer_range),
    )
    try:
        return d.replace(**fields)
    except (ConfigError, TypeError) as exc:
        raise CheckpointError(f"{source}: args describe no valid GPT-OSS architecture "
                              f"({getattr(exc, 'message', None) or first_line(exc)})") from None


__all__ = ["megatron_args", "arch_from_args", "RecordedArgs", "WINDOW_FIELDS", "POSITION_FIELD", "ARCH_FROM_HINT"]
