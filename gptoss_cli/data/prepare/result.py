"""What a `prepare-data` run wrote: one result for every format, which the command renders as a table or JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PrepareResult:
    """The files and counts every format has, the format's own figures (`details`, written to --json as
    they are) and its rows of the summary table (`summary`, what the command shows between the tokens and
    the files)."""

    format: str  # the --format that wrote it
    bin_path: str
    header_path: str
    files: list[str]  # every file written, the header last
    num_tokens: int
    num_documents: int
    dtype: str
    vocab_size: int
    sources: list[str]
    details: dict[str, Any] = field(default_factory=dict)
    summary: list[tuple[str, str]] = field(default_factory=list)  # (label, value)
    num_skipped: int = 0  # rows that did not parse, left out with --errors skip
    skipped: list[str] = field(default_factory=list)  # the first few of them: "FILE:ROW: why"

    def to_dict(self) -> dict[str, Any]:
        """The --json record: the common fields and the format's details (the table rows are not data)."""
        return {"format": self.format, "bin_path": self.bin_path, "header_path": self.header_path,
                "files": list(self.files), "num_tokens": self.num_tokens, "num_documents": self.num_documents,
                "dtype": self.dtype, "vocab_size": self.vocab_size, **self.details, "sources": list(self.sources),
                "num_skipped": self.num_skipped, "skipped": list(self.skipped)}


__all__ = ["PrepareResult"]
