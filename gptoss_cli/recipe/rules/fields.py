"""Field bounds: every number finite and at or above its schema minimum (the gate rule)."""

from __future__ import annotations

import math

from gptoss_cli.recipe.rules.core import Context, Finding, error, field_value, rule
from gptoss_cli.recipe.schema import RecipeConfig, iter_fields


# --- field bounds ----------------------------------------------------------------------------
_FLOAT32_MAX = 3.4028234663852886e38


@rule("field.range", "numbers finite and at or above their minimum (sizes >= 1, rates >= 0, ...)", gate=True,
      fix="set the named field to a finite number at or above its minimum")
def field_range(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    out = []
    for dotted, f in iter_fields():
        value = field_value(cfg, dotted)
        # YAML .inf, .nan, 1e400; and beyond float32, which the optimizer computes in (torch refuses it)
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
            out.append(error({dotted: value}, f"{dotted}={value} is not a finite (float32) number",
                             f"set {dotted} to a finite value"))
            continue
        low = f.metadata.get("min")
        if low is None:
            continue
        if value is not None and not isinstance(value, bool) and value < low:
            out.append(error({dotted: value}, f"{dotted}={value} is below its minimum {low}",
                             f"set {dotted} to a value >= {low}"))
    return out
