"""Which layers and pieces a HybridModel recomputes in backward (pure Python: the memory estimate reads it too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Each selective module and the layer kinds (pattern symbols) it recomputes a piece of; the rule that
# warns about a module without a layer in the pattern reads this too.
SELECTIVE_MODULES = {"core_attn": "*", "moe_act": "E", "layernorm": "*E-", "mlp": "-", "moe": "E"}


@dataclass(frozen=True)
class RecomputePlan:
    """What a HybridModel recomputes: selective `modules` and/or `full_units` [(start, end) layers)."""

    modules: frozenset[str] = frozenset()
    full_units: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        unknown = sorted(set(self.modules) - set(SELECTIVE_MODULES))
        if unknown:
            raise ValueError(f"unknown recompute modules {unknown}; choose from {list(SELECTIVE_MODULES)}")

    @property
    def enabled(self) -> bool:
        return bool(self.modules or self.full_units)

    @classmethod
    def from_settings(cls, granularity: str, modules: Any = (), method: str | None = None,
                      num_layers: int | None = None, total_layers: int = 0) -> "RecomputePlan":
        """Megatron's recipe fields -> a plan for a stack of `total_layers` physical layers.

        full/uniform: the layers in units of `num_layers` consecutive layers, each unit recomputed
        from its input; full/block: the first `num_layers` layers each recomputed from its own input."""
        if granularity == "selective":
            return cls(modules=frozenset(modules or ()))
        if granularity != "full":
            return cls()
        n = int(num_layers or 0)
        if n < 1:
            raise ValueError("full recompute needs num_layers >= 1")
        if method == "uniform":
            return cls(full_units=tuple((s, min(s + n, total_layers)) for s in range(0, total_layers, n)))
        if method == "block":
            return cls(full_units=tuple((j, j + 1) for j in range(min(n, total_layers))))
        raise ValueError(f"full recompute method {method!r} is not uniform or block")

    def layer_pieces(self, symbols: list[str] | tuple[str, ...]) -> dict[int, set[str]]:
        """Per physical layer j, what it recomputes: "layer" (full) or the selective modules."""
        out: dict[int, set[str]] = {}
        full = {j for s, e in self.full_units for j in range(s, e)}
        for j in range(len(symbols)):
            out[j] = {"layer"} if j in full else set(self.modules)
        return out


__all__ = ["SELECTIVE_MODULES", "RecomputePlan"]
