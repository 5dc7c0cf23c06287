"""The typer application and the one place where library errors become one-line messages."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

import typer
from rich.console import Console, ConsoleDimensions
from rich.text import Text
from typer.core import TyperGroup

from gptoss_cli import outputs
from gptoss_cli.allocation import is_allocation_failure, out_of_memory
from gptoss_cli.errors import (
    FileSystemError, GptossError, OutOfMemory, Terminated, UsageError, describe_os_error, note_signal, signal_since,
    signals_seen,
)

class _OneLineUsageErrors(TyperGroup):
    """Click's usage errors (an option value outside its range or of the wrong type, a missing argument,
    an unknown option or command) as one `error:` line pointing at the command's --help, exit 2, instead
    of Typer's boxed usage text. Asking for help (no arguments) still prints the help."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with _one_line_usage():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with _one_line_usage():
            return super().invoke(ctx)


try:  # typer >= 0.2x parses with its own copy of click
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover  (older typer: click itself)
    from click import exceptions as _click_errors


@contextlib.contextmanager
def _one_line_usage() -> Any:
    try:
        yield
    except _click_errors.NoArgsIsHelpError:
        raise
    except _click_errors.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "gptoss"
        print_error(f"{exc.format_message()} (see `{where} --help`)")
        raise typer.Exit(exc.exit_code) from None


app = typer.Typer(
    cls=_OneLineUsageErrors,
    name="gptoss",
    help=(
        "Convert, validate, train and parity-check OpenAI GPT-OSS (20B/120B) models.\n\n"
        "Example: gptoss make-tiny /tmp/tiny && gptoss convert /tmp/tiny /tmp/tiny-hybrid"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Lines for a file, a pipe or a batch scheduler's log (sbatch, CI, `| tee`) are never wrapped: rich's
# default of 80 columns off a terminal split step lines in two and fix commands mid-word.
LOG_WIDTH = 10_000


class LogConsole(Console):
    """A console that wraps at a terminal's width and, off a terminal, writes every line at full length
    (tables at their natural width) unless COLUMNS says otherwise. Decided at each print, so the
    module-level consoles follow wherever stdout goes (a test runner swaps it)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        if kwargs.get("width") is None:
            self._width = None  # rich froze COLUMNS of the moment in here; `size` reads it when printing

    @property
    def size(self) -> ConsoleDimensions:
        if self.is_terminal or self._width is not None:  # a terminal, or a width set on purpose
            return super().size
        columns = os.environ.get("COLUMNS", "")  # now, not when the console was made
        return ConsoleDimensions(int(columns) if columns.isdigit() else LOG_WIDTH, super().size.height)


def make_console(stderr: bool = False) -> Console:
    return LogConsole(stderr=stderr)


console = make_console(stderr=False)
err_console = make_console(stderr=True)

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM


def print_error(message: str, label: str = "error: ") -> None:
    """One red-labelled line; the message is printed verbatim (paths like `x[/y]` are not markup)."""
    line = Text(label, style="bold red")
    line.append(" ".join(str(message).split("\n")))
    err_console.print(line, highlight=False, soft_wrap=True)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a GptossError, an OSError, an allocation failure, Ctrl-C or SIGTERM into one line and its exit
    code, never a traceback. A failure a command ends with after a signal arrived (one of ours, a RuntimeError,
    an OSError) is that signal's (130 / 143): its exception was turned into another on the way out (torch's
    C++ zip writer, a library's wrapper)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mark = signals_seen()
        try:
            result = fn(*args, **kwargs)
            # a signal whose exception something swallowed (a finaliser, a C++ frame): the work is done, but
            # the command still ends as the signal asked
            stop = signal_since(mark)
            if stop is None:
                return result
            _exit_for(stop)
        except (typer.Exit, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - each kind below is one line; anything else is re-raised
            stop = signal_since(mark)
            # what a signal's exception becomes on its way through C++ or a library's wrapper; a bug stays itself
            swallowed = isinstance(exc, (GptossError, RuntimeError, OSError))
            _exit_for(stop if stop is not None and swallowed else exc)

    return wrapper


def _exit_for(exc: BaseException) -> None:
    """Print `exc` as one line and raise its exit code; re-raise what is not ours to turn into a line (a bug)."""
    try:
        raise exc
    except GptossError:
        print_error(str(exc))
        raise typer.Exit(exc.exit_code) from None
    except OSError:  # an unwritable, missing or full path the library did not name itself
        print_error(describe_os_error(exc))
        raise typer.Exit(FileSystemError.exit_code) from None
    except (MemoryError, RuntimeError):  # an allocator's failure that no reader named (allocation.py)
        if not is_allocation_failure(exc):
            raise
        print_error(str(out_of_memory(None, exc)))
        raise typer.Exit(OutOfMemory.exit_code) from None
    except KeyboardInterrupt:  # a command may say what survives in the message (train does)
        print_error(str(exc) or "nothing was left half-written", label="interrupted: ")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Terminated:
        print_error(str(exc) or "nothing was left half-written", label="terminated: ")
        raise typer.Exit(EXIT_TERMINATED) from None


def check_number(option: str, value: float | None, *, low: float | None = None, high: float | None = None,
                 low_inclusive: bool = True) -> None:
    """A numeric option is finite and inside its range (typer accepts 'nan' and 'inf' for floats)."""
    import math

    if value is None:
        return
    bad = not math.isfinite(value)
    if low is not None:
        bad = bad or (value < low if low_inclusive else value <= low)
    if high is not None:
        bad = bad or value > high
    if bad:
        lo = "" if low is None else ("[" if low_inclusive else "(") + f"{low:g}"
        hi = "" if high is None else f"{high:g}]"
        where = f"in {lo or '(-inf'}, {hi or 'inf)'}"
        raise UsageError(f"{option} {value!r} must be a finite number {where}")


def check_json_path(path: Path | None) -> None:
    """Refuse a --json path that cannot be written before any work is done."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"--json {path}: is a folder", hint="give a file name")
    outputs.check_writable_location(path, "--json")


def strict_json(value: Any) -> Any:
    """`value` with every NaN or infinite float as None: JSON has no such numbers (Python's `NaN` and
    `Infinity` are rejected by strict readers), so a value that is not a number is written as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write_json(path: Path, payload: Any, done: str | None = None) -> None:
    """Write a machine-readable result atomically (temporary name, then rename), as strict JSON
    (`strict_json`: NaN and infinities become null).

    `done` says what already succeeded (e.g. "converted to /x"): a failure here must not read as
    if that work had been lost.
    """
    path = Path(path)
    tmp = outputs.temp_path(path, outputs.TMP)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(strict_json(payload), indent=2, default=str, allow_nan=False)
        tmp.write_text(text + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # the folder itself is missing or unwritable: nothing was created
            pass
        prefix = f"{done}, but " if done else ""
        raise FileSystemError(f"{prefix}the JSON summary could not be written: {describe_os_error(exc)}") from None


def print_note(note: str) -> None:
    """One yellow-labelled `note: ` line on stderr (what a command cleaned up or assumed)."""
    err_console.print(Text("note: ", style="yellow") + Text(note), highlight=False, soft_wrap=True)


def _terminate(signum: int, frame: Any) -> None:
    note_signal(signum)
    raise Terminated()


def _interrupt(signum: int, frame: Any) -> None:
    note_signal(signum)  # then what Python's own handler does
    raise KeyboardInterrupt()


def install_signal_handlers() -> None:
    """SIGTERM unwinds like Ctrl-C, so the `finally` blocks that remove temporary folders run; both are
    recorded (errors.note_signal) so that one C++ turned into its own error still ends the run as itself."""
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _interrupt)


def main() -> None:
    install_signal_handlers()
    app(prog_name="gptoss")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
