"""The typer application and the one place where library errors become one-line messages."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import typer
from rich.console import Console

from gptoss_cli.errors import GptossError

app = typer.Typer(
    name="gptoss",
    help=(
        "Convert, validate, train and parity-check OpenAI GPT-OSS (20B/120B) models.\n\n"
        "Example: gptoss make-tiny /tmp/tiny && gptoss convert /tmp/tiny /tmp/tiny-hybrid"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

console = Console(stderr=False)
err_console = Console(stderr=True)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a GptossError (or a bad-input OSError) into one red line and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except GptossError as exc:
            err_console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]; nothing was left half-written")
            raise typer.Exit(130) from None

    return wrapper


def write_json(path: Path, payload: Any) -> None:
    """Write a machine-readable result atomically (temporary name, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def main() -> None:
    app(prog_name="gptoss")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
