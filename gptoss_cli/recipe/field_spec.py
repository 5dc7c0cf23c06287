"""How a recipe field is declared: its default and `metadata` (help, choices, bounds), shared by every section module."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def spec(default: Any = None, help: str = "", *, choices: tuple | None = None, min: float | None = None,
         max: float | None = None, below: float | None = None, factory: Any = None) -> Any:
    """A dataclass field with the schema's metadata (recipe/schema.py's module docstring says what each means)."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if min is not None:
        meta["min"] = min
    if max is not None:
        meta["max"] = max
    if below is not None:
        meta["below"] = below
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


__all__ = ["spec"]
