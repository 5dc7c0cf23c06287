"""Error types of gptoss and their exit codes; the CLI turns them into one-line messages."""

from __future__ import annotations

import os
import signal


class GptossError(Exception):
    """A failure the user can act on. The message names the culprit and, where known, the fix."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class UsageError(GptossError):
    """Bad input: a missing file, a malformed checkpoint, an invalid option value."""

    exit_code = 2


class CheckpointError(UsageError):
    """A checkpoint that cannot be read or does not match its config."""


class ConfigError(UsageError):
    """A recipe or config file that is missing, not parseable, or has unknown/ill-typed fields."""


class ValidationFailed(GptossError):
    """A recipe that parsed but breaks one or more rules (exit 1)."""

    exit_code = 1


class ParityFailure(GptossError):
    """A conversion that does not compute what the source computes (exit 1)."""

    exit_code = 1


class TrainingError(GptossError):
    """A training run that had to stop: NaN loss, a failed worker, a bad resume point."""

    exit_code = 1


class OutOfMemory(GptossError):
    """An allocation that failed, or a claim no allocation here could meet: names what was being read (exit 1)."""

    exit_code = 1


class Terminated(BaseException):
    """SIGTERM arrived: unwinds like KeyboardInterrupt (temporary files are removed on the way out)."""


# Every SIGINT / SIGTERM the CLI's handlers saw (cli/app.py), in order. A handler's exception raised inside
# a Python callback that C++ called (torch's zip writer calling a file's `write`) comes out of C++ as that
# code's own error ("unexpected pos"); the record still says a signal arrived, so the run ends as the signal.
_SIGNALS_SEEN: list[int] = []


def note_signal(signum: int) -> None:
    """Record that `signum` arrived (the CLI's handlers call this before raising)."""
    _SIGNALS_SEEN.append(signum)


def signals_seen() -> int:
    """A mark: how many signals have been recorded so far (for `signal_since`)."""
    return len(_SIGNALS_SEEN)


def signal_since(mark: int) -> BaseException | None:
    """The exception of the first signal recorded after `mark` (KeyboardInterrupt or Terminated), or None."""
    for signum in _SIGNALS_SEEN[mark:]:
        return KeyboardInterrupt() if signum == signal.SIGINT else Terminated()
    return None


class FileSystemError(UsageError):
    """An operating-system error on a named path: unwritable, missing, full disk, a file where a folder goes."""


def describe_os_error(exc: OSError, action: str | None = None) -> str:
    """One line naming the path(s) and the reason of an OSError, e.g. '/ro/x: Read-only file system'."""
    reason = exc.strerror or (os.strerror(exc.errno) if exc.errno else "") or str(exc) or type(exc).__name__
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    where = " -> ".join(paths)
    text = f"{where}: {reason}" if where else reason
    return f"{action}: {text}" if action else text


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), or its type's name when it has none."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def file_system_error(exc: OSError, action: str | None = None, hint: str | None = None) -> FileSystemError:
    """The FileSystemError for an OSError (raise it `from None`: the message already says everything)."""
    return FileSystemError(describe_os_error(exc, action), hint)


def require_extra(module: str, purpose: str, extra: str, field: str | None = None, package: str | None = None):
    """Import an optional package, or raise the one-line UsageError that names what needs it and the
    extra that installs it (`field`: the recipe field that asked for it; `package`: the missing
    package's name where the module imported belongs to another, as torch.utils.tensorboard does)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        asked = f" ({field})" if field else ""
        raise UsageError(f"{purpose}{asked} needs the `{package or module.split('.')[0]}` package, which is not "
                         "installed",
                         hint=f"pip install 'gptoss-cli[{extra}]'") from None
