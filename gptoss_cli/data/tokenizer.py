"""A checkpoint's tokenizer.json: where it is in a folder, and reading it with the `tokenizers` package (no torch here).

prepare-data and generate both take "a tokenizer.json or a folder holding one"; each reports a
missing file in its own words (which option, what to pass instead), then reads it here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptoss_cli.errors import UsageError

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_path(path: str | Path) -> Path:
    """`path` itself, or the tokenizer.json in it when it is a folder (whether that exists is the caller's to say)."""
    path = Path(path)
    return path / TOKENIZER_FILE if path.is_dir() else path


def read_tokenizer(file: Path, command: str) -> Any:
    """A `tokenizers.Tokenizer` from a tokenizer.json. A missing `tokenizers` package (which `command` needs)
    or a file it cannot read is a one-line UsageError."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(f"{command} needs the `tokenizers` package", hint="pip install 'gptoss-cli[data]'") from None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the tokenizers library raises a bare Exception for bad files
        raise UsageError(f"{file}: not a tokenizers tokenizer.json ({str(exc).splitlines()[0]})") from None


__all__ = ["TOKENIZER_FILE", "tokenizer_path", "read_tokenizer"]
