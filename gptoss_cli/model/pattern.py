"""The Megatron hybrid layer pattern grammar: parse `*E*E`, `[*E][*E]`, `*-|*E` into layers.

Symbols (Megatron's): `*` attention, `E` mixture-of-experts MLP, `-` dense MLP, `M` Mamba,
`|` a pipeline-stage split, `[` `]` a group of layers that runs as one unit (the grouped
`[*E]` form). `M` is part of the grammar but this tool cannot build Mamba layers; asking for a
buildable model with it is an error that names the symbol and its positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gptoss_cli.errors import ConfigError

if TYPE_CHECKING:
    from gptoss_cli.model.config import GptOssArch

ATTENTION = "*"
MOE = "E"
MLP = "-"
MAMBA = "M"
LAYER_SYMBOLS = {ATTENTION: "attention", MOE: "moe", MLP: "mlp", MAMBA: "mamba"}
BUILDABLE = frozenset({ATTENTION, MOE, MLP})
# Symbols the HybridModel schedule plan (model/schedule_plan.py) has nodes for.
PLAN_SYMBOLS = frozenset({ATTENTION, MOE, MLP})


@dataclass(frozen=True)
class HybridPattern:
    """A parsed pattern: one symbol per physical layer, plus grouping and pipeline structure."""

    text: str
    layers: tuple[str, ...]
    # groups[k] = (first_layer, last_layer_exclusive); ungrouped layers are groups of one.
    groups: tuple[tuple[int, int], ...]
    # indices of the first layer of each pipeline stage after the first
    pipeline_splits: tuple[int, ...]
    grouped: bool

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_pipeline_stages(self) -> int:
        return len(self.pipeline_splits) + 1

    def kinds(self) -> tuple[str, ...]:
        return tuple(LAYER_SYMBOLS[s] for s in self.layers)

    def require_buildable(self, allowed: frozenset[str] = BUILDABLE) -> None:
        bad = sorted({s for s in self.layers if s not in allowed})
        if bad:
            where = {s: [i for i, x in enumerate(self.layers) if x == s] for s in bad}
            names = ", ".join(f"{s!r} ({LAYER_SYMBOLS[s]}) at layers {where[s][:8]}" for s in bad)
            raise ConfigError(
                f"hybrid_layer_pattern {self.text!r}: this tool cannot build {names}",
                hint=f"use only {sorted(allowed)}",
            )


def parse_pattern(text: str) -> HybridPattern:
    """Parse a pattern string fully, rejecting unknown symbols and unbalanced groups by position."""
    if not isinstance(text, str):
        raise ConfigError(f"hybrid_layer_pattern {text!r} must be a string such as '*E*E'")
    if not text.strip():
        raise ConfigError(f"hybrid_layer_pattern {text!r} is empty")
    layers: list[str] = []
    groups: list[tuple[int, int]] = []
    splits: list[int] = []
    group_start: int | None = None
    grouped = False
    for pos, ch in enumerate(text):
        if ch.isspace():
            continue
        if ch in LAYER_SYMBOLS:
            if group_start is None:
                groups.append((len(layers), len(layers) + 1))
            layers.append(ch)
        elif ch == "[":
            if group_start is not None:
                raise ConfigError(f"hybrid_layer_pattern {text!r}: nested '[' at position {pos}")
            group_start = len(layers)
            grouped = True
        elif ch == "]":
            if group_start is None:
                raise ConfigError(f"hybrid_layer_pattern {text!r}: ']' without '[' at position {pos}")
            if group_start == len(layers):
                raise ConfigError(f"hybrid_layer_pattern {text!r}: empty group '[]' at position {pos}")
            groups.append((group_start, len(layers)))
            group_start = None
        elif ch == "|":
            if group_start is not None:
                raise ConfigError(
                    f"hybrid_layer_pattern {text!r}: pipeline split '|' inside a group at position {pos}"
                )
            if not layers or (splits and splits[-1] == len(layers)):
                raise ConfigError(f"hybrid_layer_pattern {text!r}: empty pipeline stage at position {pos}")
            splits.append(len(layers))
        else:
            raise ConfigError(
                f"hybrid_layer_pattern {text!r}: unknown symbol {ch!r} at position {pos}",
                hint="known symbols: * (attention), E (MoE), - (MLP), M (Mamba), | (pipeline split), [ ] (group)",
            )
    if group_start is not None:
        raise ConfigError(f"hybrid_layer_pattern {text!r}: '[' at layer {group_start} is never closed")
    if not layers:
        raise ConfigError(f"hybrid_layer_pattern {text!r} has no layers")
    if splits and splits[-1] == len(layers):
        raise ConfigError(f"hybrid_layer_pattern {text!r}: empty last pipeline stage")
    return HybridPattern(
        text=text, layers=tuple(layers), groups=tuple(groups), pipeline_splits=tuple(splits), grouped=grouped
    )


def default_pattern(arch: GptOssArch) -> HybridPattern:
    """The pattern of a model whose recipe or checkpoint names none: `arch.hybrid_layer_pattern`, one `*E`
    per HF block (the layout convert writes), parsed."""
    return parse_pattern(arch.hybrid_layer_pattern)


def layer_windows(arch: GptOssArch, pattern: HybridPattern) -> dict[int, int | None]:
    """Sliding window of every attention layer (None: full attention), keyed by physical layer index:
    the k-th attention layer is HF block k. Torch-free: the model, parity and the memory estimate share it."""
    windows: dict[int, int | None] = {}
    block = 0
    for j, symbol in enumerate(pattern.layers):
        if symbol == ATTENTION:
            windows[j] = arch.sliding_window if arch.is_sliding(block) else None
            block += 1
    return windows


def schedule_plan_support(pattern: HybridPattern) -> tuple[bool, str]:
    """Whether the combined-1F1B schedule plan (model/schedule_plan.py) can split `pattern` into
    nodes: (True, "") when every symbol is `*`, `E` or `-` (grouped or not) and there is no `|`,
    else (False, the reason naming the symbol or the split)."""
    bad = sorted({s for s in pattern.layers if s not in PLAN_SYMBOLS})
    if bad:
        names = ", ".join(f"{s!r} ({LAYER_SYMBOLS.get(s, '?')})" for s in bad)
        return False, f"the HybridModel schedule plan has no nodes for layer symbol {names}"
    if pattern.pipeline_splits:
        return False, "the HybridModel schedule plan does not split pipeline stages ('|' in the pattern)"
    return True, ""
