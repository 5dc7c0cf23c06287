"""The FP8 recipes and formats gptoss implements and what each needs: the one list every consumer reads (no torch here).

The recipe schema (`precision.fp8_recipe` / `fp8_format` choices), the precision rules and
fp8/selection.py (kernel selection) all read these; the recipe layer stays torch-free, so this module
imports nothing heavier than dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fp8Recipe:
    """One `precision.fp8_recipe` value: how it scales and which GPUs run it natively."""

    name: str
    scaling: str  # gptoss_cli/fp8/scaling.py: "tensor" (one scale per operand), "row", "mx" (UE8M0 per 32 values)
    native_capability: tuple[int, int]  # the CUDA compute capability its native kernel needs
    generation: str  # the GPU generation of that capability: "Hopper" (sm90) or "Blackwell" (sm100)


# In the order the schema lists them (after "none").
RECIPES: dict[str, Fp8Recipe] = {r.name: r for r in (
    Fp8Recipe("tensorwise", "tensor", (9, 0), "Hopper"),
    Fp8Recipe("rowwise", "row", (9, 0), "Hopper"),
    Fp8Recipe("mxfp8", "mx", (10, 0), "Blackwell"),
)}
# precision.fp8_format: e4m3 everywhere, or hybrid (output gradients e5m2, inputs and weights e4m3).
FORMATS = ("e4m3", "hybrid")

__all__ = ["Fp8Recipe", "RECIPES", "FORMATS"]
