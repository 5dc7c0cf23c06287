"""Command-line interface: parse options, call one library function, render its result.

Each command lives in its own module of this package and registers itself on `app`.
No logic here: the library never imports this package or rich's console.

Start-up: `gptoss --help` imports every command module, so a command module imports at its top
only typer, rich, gptoss_cli.cli.app and torch-free library modules it needs to define its options;
the library it calls (torch, the recipe package's omegaconf) is imported inside the command
function. tests/test_cli_commands.py holds every command to it: `gptoss --help` and each
command's `--help` import neither torch nor omegaconf, and validate-config imports no torch.
"""

from __future__ import annotations

# Each command module registers itself on `app` when imported; `gptoss --help` lists the commands
# in this order. A missing module is an ImportError here, not a command that silently disappears.
from gptoss_cli.cli import (  # noqa: F401, I001
    convert, make_tiny, validate, parity, train, prepare_data, demo, evaluate, score, generate, report, serve_check,
    doctor,
)
from gptoss_cli.cli.app import app, main  # noqa: F401
