"""Command-line interface: parse options, call one library function, render its result.

Each command lives in its own module of this package and registers itself on `app`.
No logic here: the library never imports this package or rich's console.
"""

from __future__ import annotations

# Each command module registers itself on `app` when imported; `gptoss --help` lists the commands
# in this order. A missing module is an ImportError here, not a command that silently disappears.
from gptoss_cli.cli import (  # noqa: F401, I001
    convert, make_tiny, validate, parity, train, prepare_data, demo, evaluate, generate, report, serve_check, doctor,
)
from gptoss_cli.cli.app import app, main  # noqa: F401
