"""Hugging Face and OpenAI `config.json` <-> `GptOssArch`: the checkpoint side's adapter to the architecture.

`model/config.py` holds the architecture and its validation; this module reads the two config.json
forms a GPT-OSS checkpoint comes with (HF's, in its released form with `rope_scaling` or
transformers 5's `rope_parameters`, and OpenAI's `original/config.json`) and writes HF's as the
released models do (rope_theta + rope_scaling with YaRN, layer_types, quantization_config when the
experts are MXFP4). Every error names the file (`source`) and the field.
"""

from __future__ import annotations

from typing import Any

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.config import GptOssArch

# Files copied alongside the weights in both directions (and fetched with them from the Hub).
EXTRA_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def from_hf_config(cfg: dict[str, Any], *, source: str = "config.json") -> GptOssArch:
    """Read a GPT-OSS HF config.json (released form with rope_scaling, or transformers 5's rope_parameters)."""
    if cfg.get("model_type") != "gpt_oss":
        raise ConfigError(
            f"{source}: model_type is {cfg.get('model_type')!r}, expected 'gpt_oss'",
            hint="gptoss converts GPT-OSS checkpoints only",
        )
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if rope is None:
        # As transformers' GptOssConfig: no rope_scaling means GPT-OSS's own YaRN, truncate false.
        rope = {"rope_type": "yarn", "truncate": False}
    if not isinstance(rope, dict):
        raise ConfigError(f"{source}: rope_scaling must be a mapping (or null), got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "yarn"))
    if rope_type != "yarn":
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported; GPT-OSS uses 'yarn'")
    defaults = GptOssArch()
    required = [
        "num_hidden_layers", "num_local_experts", "hidden_size", "intermediate_size",
        "num_attention_heads", "num_key_value_heads", "vocab_size",
    ]
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ConfigError(f"{source}: missing fields {missing}")
    try:
        return GptOssArch(
            num_hidden_layers=cfg["num_hidden_layers"],
            num_local_experts=cfg["num_local_experts"],
            num_experts_per_tok=cfg.get("num_experts_per_tok", cfg.get("experts_per_token", 4)),
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"],
            sliding_window=cfg.get("sliding_window") or defaults.sliding_window,
            layer_types=tuple(cfg["layer_types"]) if cfg.get("layer_types") else None,
            max_position_embeddings=cfg.get("max_position_embeddings", defaults.max_position_embeddings),
            rms_norm_eps=cfg.get("rms_norm_eps", defaults.rms_norm_eps),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", defaults.rope_theta)),
            rope_scaling_factor=rope.get("factor", defaults.rope_scaling_factor),
            rope_beta_fast=rope.get("beta_fast", defaults.rope_beta_fast),
            rope_beta_slow=rope.get("beta_slow", defaults.rope_beta_slow),
            rope_original_max_position_embeddings=rope.get(
                "original_max_position_embeddings", defaults.rope_original_max_position_embeddings
            ),
            rope_truncate=rope.get("truncate", True),  # transformers' YaRN default
            swiglu_limit=cfg.get("swiglu_limit", defaults.swiglu_limit),
            swiglu_alpha=cfg.get("swiglu_alpha", defaults.swiglu_alpha),
            router_aux_loss_coef=cfg.get("router_aux_loss_coef", defaults.router_aux_loss_coef),
            initializer_range=cfg.get("initializer_range", defaults.initializer_range),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc.message}", exc.hint) from None
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise ConfigError(f"{source}: {exc}") from None

def from_openai_config(cfg: dict[str, Any], *, source: str = "original/config.json") -> GptOssArch:
    """Read the config.json of OpenAI's `original/` checkpoint layout."""
    required = [
        "num_hidden_layers", "num_experts", "experts_per_token", "vocab_size", "hidden_size",
        "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads",
    ]
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ConfigError(f"{source}: missing fields {missing}")
    d = GptOssArch()
    try:
        initial = int(cfg.get("initial_context_length", d.rope_original_max_position_embeddings))
        factor = float(cfg.get("rope_scaling_factor", d.rope_scaling_factor))
        return GptOssArch(
            num_hidden_layers=cfg["num_hidden_layers"],
            num_local_experts=cfg["num_experts"],
            num_experts_per_tok=cfg["experts_per_token"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            vocab_size=cfg["vocab_size"],
            sliding_window=cfg.get("sliding_window", d.sliding_window),
            max_position_embeddings=int(initial * factor),
            rope_theta=float(cfg.get("rope_theta", d.rope_theta)),
            rope_scaling_factor=factor,
            rope_beta_fast=float(cfg.get("rope_ntk_beta", d.rope_beta_fast)),
            rope_beta_slow=float(cfg.get("rope_ntk_alpha", d.rope_beta_slow)),
            rope_original_max_position_embeddings=initial,
            rope_truncate=False,
            swiglu_limit=float(cfg.get("swiglu_limit", d.swiglu_limit)),
            # original/config.json has no token ids: the released ones, where the vocabulary holds them
            eos_token_id=d.eos_token_id if _fits(d.eos_token_id, cfg["vocab_size"]) else None,
            pad_token_id=d.pad_token_id if _fits(d.pad_token_id, cfg["vocab_size"]) else None,
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc.message}", exc.hint) from None
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise ConfigError(f"{source}: {exc}") from None

def to_hf_config(arch: GptOssArch, *, experts_form: str = "bf16", torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json as the released GPT-OSS models write it."""
    cfg: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": arch.eos_token_id,
        "experts_per_token": arch.num_experts_per_tok,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "hidden_size": arch.hidden_size,
        "initial_context_length": arch.rope_original_max_position_embeddings,
        "initializer_range": arch.initializer_range,
        "intermediate_size": arch.intermediate_size,
        "layer_types": list(arch.layer_types),
        "max_position_embeddings": arch.max_position_embeddings,
        "model_type": "gpt_oss",
        "num_attention_heads": arch.num_attention_heads,
        "num_experts_per_tok": arch.num_experts_per_tok,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_key_value_heads": arch.num_key_value_heads,
        "num_local_experts": arch.num_local_experts,
        "output_router_logits": False,
        "pad_token_id": arch.pad_token_id,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_scaling": {
            "beta_fast": arch.rope_beta_fast,
            "beta_slow": arch.rope_beta_slow,
            "factor": arch.rope_scaling_factor,
            "original_max_position_embeddings": arch.rope_original_max_position_embeddings,
            "rope_type": "yarn",
            "truncate": arch.rope_truncate,
        },
        "rope_theta": arch.rope_theta,
        "router_aux_loss_coef": arch.router_aux_loss_coef,
        "sliding_window": arch.sliding_window,
        "swiglu_alpha": arch.swiglu_alpha,
        "swiglu_limit": arch.swiglu_limit,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "use_cache": True,
        "vocab_size": arch.vocab_size,
    }
    if experts_form == "mxfp4":
        cfg["quantization_config"] = {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        }
    return cfg


def _fits(token_id: Any, vocab_size: Any) -> bool:
    return isinstance(vocab_size, int) and isinstance(token_id, int) and token_id < vocab_size


__all__ = ["EXTRA_FILES", "from_hf_config", "from_openai_config", "to_hf_config"]
