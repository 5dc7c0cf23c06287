"""Field bounds: every number finite and at or above its schema minimum (the gate rule)."""

from __future__ import annotations


from gptoss_cli.recipe.rules.core import Context, Finding, error, field_value, rule
from gptoss_cli.recipe.schema import RecipeConfig, iter_fields


# --- field bounds ----------------------------------------------------------------------------
@rule("field.range", "numbers at or above their minimum (sizes >= 1, rates >= 0, ...)", gate=True)
def field_range(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    out = []
    for dotted, f in iter_fields():
        low = f.metadata.get("min")
        if low is None:
            continue
        value = field_value(cfg, dotted)
        if value is not None and not isinstance(value, bool) and value < low:
            out.append(error({dotted: value}, f"{dotted}={value} is below its minimum {low}",
                             f"set {dotted} to a value >= {low}"))
    return out
