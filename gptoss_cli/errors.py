"""Error types of gptoss and their exit codes; the CLI turns them into one-line messages."""

from __future__ import annotations


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
