"""Command-line interface: parse options, call one library function, render its result.

Each command lives in its own module of this package and registers itself on `app`.
No logic here: the library never imports this package or rich's console.
"""

from __future__ import annotations

import importlib

from gptoss_cli.cli.app import app, main  # noqa: F401

# Command modules register themselves on import; a module that is not there yet is skipped so
# that the package stays usable while commands are added one issue at a time.
for _name in ("convert", "make_tiny", "validate", "parity", "train", "prepare_data", "demo", "evaluate", "generate", "report"):
    try:
        importlib.import_module(f"gptoss_cli.cli.{_name}")
    except ModuleNotFoundError as exc:  # pragma: no cover - only while a command is missing
        if exc.name != f"gptoss_cli.cli.{_name}":
            raise
