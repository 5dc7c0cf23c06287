"""Field bounds: every number finite and inside the range its schema field declares (the gate rule)."""

from __future__ import annotations

import math

from gptoss_cli.recipe.rules.core import Context, Finding, error, field_value, rule
from gptoss_cli.recipe.schema import RecipeConfig, iter_fields


# --- field bounds ----------------------------------------------------------------------------
_FLOAT32_MAX = 3.4028234663852886e38


@rule("field.range", "numbers finite and inside the range their consumer accepts (sizes >= 1, counts and sizes "
      "<= 2**31-1, seeds <= 2**32-1, betas < 1, ...)", gate=True,
      fix="set the named field to a finite number inside its range")
def field_range(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    out = []
    for dotted, f in iter_fields():
        value = field_value(cfg, dotted)
        # YAML .inf, .nan, 1e400; and beyond float32, which the optimizer computes in (torch refuses it)
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
            out.append(error({dotted: value}, f"{dotted}={value} is not a finite (float32) number",
                             f"set {dotted} to a finite value"))
            continue
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        low, high, below = (f.metadata.get(k) for k in ("min", "max", "below"))
        if low is not None and value < low:
            out.append(error({dotted: value}, f"{dotted}={value} is below its minimum {low}",
                             f"set {dotted} to a value >= {low}"))
        elif high is not None and value > high:
            out.append(error({dotted: _short(value)}, f"{dotted}={_short(value)} is above its maximum {high}",
                             f"set {dotted} to a value <= {high}"))
        elif below is not None and value >= below:
            out.append(error({dotted: value}, f"{dotted}={value} must be below {below}",
                             f"set {dotted} to a value < {below}"))
    return out


def _short(value: int | float) -> int | float | str:
    """A value as a finding shows it: a 5,000-digit integer as its first digits and its length."""
    if isinstance(value, int) and abs(value) >= 10**30:
        text = str(abs(value))
        return f"{'-' if value < 0 else ''}{text[:12]}...({len(text)} digits)"
    return value
