"""GPT-OSS architecture: the one place sizes live, their validation, and the presets.

Numbers are from `gpt-oss-reference.md` section 1. Reading and writing a checkpoint's HF or OpenAI
config.json is the checkpoint side's job (`checkpoint/formats/hf/config.py`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from gptoss_cli.errors import ConfigError

SLIDING = "sliding_attention"
FULL = "full_attention"
# Fields that do not change what the network computes; a checkpoint may differ from a model in them.
NON_ARCHITECTURAL = frozenset({"router_aux_loss_coef", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id"})

# Upper bounds far above any real model (GPT-OSS-120B: 36 blocks, 128 experts, hidden 2880, vocab
# 201088, 131072 positions). They turn a typo such as num_hidden_layers: 100000000 into a one-line
# error instead of an allocation that grows until the machine runs out of memory.
INT_LIMITS = {
    "num_hidden_layers": 4096, "num_local_experts": 1 << 16, "num_experts_per_tok": 1 << 16,
    "hidden_size": 1 << 20, "intermediate_size": 1 << 20, "num_attention_heads": 1 << 14,
    "num_key_value_heads": 1 << 14, "head_dim": 1 << 14, "vocab_size": 1 << 26,
    "max_position_embeddings": 1 << 26, "sliding_window": 1 << 26, "rope_original_max_position_embeddings": 1 << 26,
}
# (low, low_inclusive, high): the ranges the formulas using them are defined on.
FLOAT_RANGES = {
    "rms_norm_eps": (0.0, False, 1.0),
    "rope_theta": (1.0, False, None),  # YaRN divides by log(rope_theta)
    "rope_scaling_factor": (0.0, False, None),
    "rope_beta_fast": (0.0, False, None),
    "rope_beta_slow": (0.0, False, None),
    "swiglu_limit": (0.0, False, None),
    "swiglu_alpha": (0.0, False, None),
    "router_aux_loss_coef": (0.0, True, None),
    "initializer_range": (0.0, True, None),
}


@dataclass(frozen=True)
class GptOssArch:
    """Architecture of a GPT-OSS model, in Hugging Face's terms (blocks, not Hybrid layers)."""

    num_hidden_layers: int = 36
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 201088
    sliding_window: int = 128
    # None means the GPT-OSS default: sliding on even blocks, full on odd ones.
    layer_types: tuple[str, ...] | None = None
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling_factor: float = 32.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_original_max_position_embeddings: int = 4096
    rope_truncate: bool = False
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    router_aux_loss_coef: float = 0.9
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 200002
    pad_token_id: int | None = 199999

    def __post_init__(self) -> None:
        # Sizes first: layer_types below is built from num_hidden_layers.
        self._check_ints()
        for name in FLOAT_RANGES:
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        if self.layer_types is None:
            object.__setattr__(
                self,
                "layer_types",
                tuple(SLIDING if i % 2 == 0 else FULL for i in range(self.num_hidden_layers)),
            )
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.check()

    # --- derived sizes -------------------------------------------------------------------
    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def qkv_rows(self) -> int:
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim

    @property
    def num_hybrid_layers(self) -> int:
        return 2 * self.num_hidden_layers

    @property
    def hybrid_layer_pattern(self) -> str:
        """The ungrouped Megatron pattern conversion emits: HF block i -> layers 2i ('*'), 2i+1 ('E')."""
        return "*E" * self.num_hidden_layers

    def is_sliding(self, block: int) -> bool:
        """Whether HF block `block` (and so Hybrid attention layer 2*block) uses the sliding window."""
        return self.layer_types[block] == SLIDING

    def _check_ints(self) -> None:
        for name, high in INT_LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"architecture field {name}={value!r} must be a positive integer")
            if value > high:
                raise ConfigError(f"architecture field {name}={value} is implausibly large (at most {high})")

    def check(self) -> None:
        """Reject architectures the model cannot be built with: types, finiteness, ranges; names the field."""
        self._check_ints()
        for name, (low, inclusive, high) in FLOAT_RANGES.items():
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ConfigError(f"architecture field {name}={value!r} must be a finite number")
            if (value < low if inclusive else value <= low) or (high is not None and value > high):
                where = f"{'>=' if inclusive else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
                raise ConfigError(f"architecture field {name}={value!r} must be {where}")
        if not isinstance(self.rope_truncate, bool):
            raise ConfigError(f"architecture field rope_truncate={self.rope_truncate!r} must be true or false")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, (list, tuple)) and name == "eos_token_id" else [value]
            for tid in ids:
                if tid is None and len(ids) == 1:
                    continue
                if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < self.vocab_size:
                    raise ConfigError(
                        f"architecture field {name}={value!r} must be a token id in [0, vocab_size={self.vocab_size})"
                    )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_experts_per_tok > self.num_local_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_local_experts={self.num_local_experts}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if any(not isinstance(t, str) for t in self.layer_types):
            raise ConfigError(f"layer_types must be a list of strings, got {list(self.layer_types)[:4]!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers="
                f"{self.num_hidden_layers}"
            )
        bad = sorted({t for t in self.layer_types if t not in (SLIDING, FULL)})
        if bad:
            raise ConfigError(f"layer_types holds unknown attention types {bad}; use {SLIDING!r} or {FULL!r}")

    def differences(self, other: "GptOssArch") -> list[str]:
        """'field: self vs other' for every field that changes what the network computes (token
        ids, the init std and the aux-loss coefficient do not)."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} vs {getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name not in NON_ARCHITECTURAL and getattr(self, f.name) != getattr(other, f.name)
        ]

    def replace(self, **changes: Any) -> "GptOssArch":
        if "num_hidden_layers" in changes and "layer_types" not in changes:
            changes["layer_types"] = None
        # A smaller vocabulary (a reduced test model) drops special-token ids it no longer holds,
        # as a new num_hidden_layers drops layer_types; ids given with it are checked as usual.
        vocab = changes.get("vocab_size")
        if isinstance(vocab, int) and not isinstance(vocab, bool):
            for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
                old = getattr(self, name)
                if name not in changes and any(isinstance(i, int) and i >= vocab for i in (
                        old if isinstance(old, (list, tuple)) else [old])):
                    changes[name] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "architecture") -> "GptOssArch":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: 'architecture' must be a mapping of fields, got a {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown architecture fields {unknown}")
        try:
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc.message}", exc.hint) from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {exc}") from None


PRESETS: dict[str, GptOssArch] = {
    "gpt_oss_20b": GptOssArch(num_hidden_layers=24, num_local_experts=32),
    "gpt_oss_120b": GptOssArch(num_hidden_layers=36, num_local_experts=128),
    # Shapes chosen to catch layout bugs: intermediate != hidden, 3 query heads per kv head,
    # a vocab that is not a round number; hidden and intermediate divisible by 32 for MXFP4/MXFP8.
    "tiny": GptOssArch(
        num_hidden_layers=3,
        num_local_experts=4,
        num_experts_per_tok=2,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1003,
        sliding_window=8,
        eos_token_id=1002,
        pad_token_id=1001,
    ),
}


def preset(name: str) -> GptOssArch:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None


__all__ = ["GptOssArch", "PRESETS", "preset", "SLIDING", "FULL"]
