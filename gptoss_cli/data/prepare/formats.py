"""The formats `prepare-data --format NAME` writes, one row each, and the options each takes.

A row names what the format reads, the `PrepareOptions` it takes (any other one given on the command line
is refused, naming it), the `--errors` values it knows, and its writer, which returns the one
`PrepareResult`: `data_format(name, options).write(inputs, out, tokenizer, options, progress)` is the
command's whole library side. A new format is a writer module in this package and one row in FORMATS; the command
line, its checks and its table need no change. Light at import: the writers (numpy, the harmony
renderer) are imported when a format runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gptoss_cli.data.prepare.result import PrepareResult
from gptoss_cli.errors import UsageError

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


@dataclass(frozen=True)
class PrepareOptions:
    """The command line's format options; a field at its default counts as not given. `field` is the column
    holding a conversation (`--field`)."""

    text_key: str = "text"
    eos_id: int | None = None
    analysis: str | None = None
    train_on: str | None = None
    max_length: int | None = None
    truncate: bool = False
    seq_length: int | None = None
    split: str | None = None
    field: str | None = None
    errors: str = "strict"
    batch_rows: int | None = None

    def given(self) -> dict[str, object]:
        """{field name: value} of the options set away from their defaults, in the order above."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}


@dataclass(frozen=True)
class DataFormat:
    """One row: `--format name`."""

    name: str
    reads: str  # what it makes of its inputs, for --format's help
    options: frozenset[str]  # the PrepareOptions it takes besides --errors
    errors: tuple[str, ...]  # the --errors values it takes
    write: Callable[[list[str], Path, Path, PrepareOptions, Progress | None], PrepareResult]


def _write_text(inputs: list[str], out: Path, tokenizer: Path, o: PrepareOptions, progress: Progress | None
                ) -> PrepareResult:
    from gptoss_cli.data.prepare.text import prepare_data

    return prepare_data([Path(p) for p in inputs], out, tokenizer, text_key=o.text_key, eos_token_id=o.eos_id,
                        progress=progress, errors=o.errors)


def _write_harmony(inputs: list[str], out: Path, tokenizer: Path, o: PrepareOptions, progress: Progress | None
                   ) -> PrepareResult:
    from gptoss_cli.data.conversation import MESSAGES_FIELD
    from gptoss_cli.data.prepare.conversations import prepare_conversations
    from gptoss_cli.data.rows import BATCH_ROWS

    return prepare_conversations(list(inputs), out, tokenizer, analysis=o.analysis or "keep",
                                 train_on=o.train_on or "last", max_length=o.max_length, truncate=o.truncate,
                                 seq_length=o.seq_length, errors=o.errors, split=o.split,
                                 field_name=o.field or MESSAGES_FIELD, batch_rows=o.batch_rows or BATCH_ROWS,
                                 progress=progress)


def _write_preference(inputs: list[str], out: Path, tokenizer: Path, o: PrepareOptions, progress: Progress | None
                      ) -> PrepareResult:
    from gptoss_cli.data.prepare.preference import prepare_preference
    from gptoss_cli.data.rows import BATCH_ROWS

    return prepare_preference(list(inputs), out, tokenizer, analysis=o.analysis or "keep", max_length=o.max_length,
                              seq_length=o.seq_length, errors=o.errors, split=o.split,
                              batch_rows=o.batch_rows or BATCH_ROWS, progress=progress)


FORMATS: dict[str, DataFormat] = {f.name: f for f in (
    DataFormat("text", "token streams", frozenset({"text_key", "eos_id"}), ("strict", "replace"), _write_text),
    DataFormat("harmony", "conversations, loss mask",
               frozenset({"analysis", "train_on", "max_length", "truncate", "seq_length", "split", "field", "batch_rows"}),
               ("strict", "replace", "skip"), _write_harmony),
    DataFormat("preference", "preference pairs, both sides in harmony, loss mask on the reply",
               frozenset({"analysis", "max_length", "seq_length", "split", "batch_rows"}),
               ("strict", "replace", "skip"), _write_preference),
)}


def data_format(name: str, options: PrepareOptions) -> DataFormat:
    """The row of `--format name`, once the options given are known to apply to it (UsageError naming those
    that do not, or the unknown format)."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise UsageError(f"--format {name!r} is not one of {', '.join(FORMATS)}")
    wrong = []
    for option, value in options.given().items():
        flag = "--" + option.replace("_", "-")
        if option == "errors":  # a value another format knows; one no format knows is the writer's to refuse
            if value not in fmt.errors and any(value in other.errors for other in FORMATS.values()):
                wrong.append(f"{flag} {value}")
        elif option not in fmt.options:
            wrong.append(flag)
    if wrong:
        raise UsageError(f"{', '.join(wrong)} {'does' if len(wrong) == 1 else 'do'} not apply to --format {name}")
    return fmt


__all__ = ["FORMATS", "DataFormat", "PrepareOptions", "data_format"]
