"""`gptoss` run as a user types it, inside the test's own process (typer's CliRunner).

`run_cli(*args)` gives click's Result (exit code, output with stdout and stderr interleaved, and any
exception the CLI let through); `exit_and_output(*args)` gives (exit code, output) and fails the test
at once on an exception the CLI did not turn into an exit, the traceback a user would see in place of
one line (tests/faults/conftest.py's `gptoss` runs it in a child process instead). A module that runs
one command binds it: `run = partial(run_cli, "generate")`.
"""

from __future__ import annotations

from click.testing import Result
from typer.testing import CliRunner

from gptoss_cli.cli import app


def run_cli(*args: object) -> Result:
    """`gptoss ARGS...`, every argument passed through str()."""
    return CliRunner().invoke(app, [str(a) for a in args])


def exit_and_output(*args: object) -> tuple[int, str]:
    """`gptoss ARGS...`: its exit code and output; an exception the CLI let through fails the test."""
    result = run_cli(*args)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, result.output


__all__ = ["run_cli", "exit_and_output"]
