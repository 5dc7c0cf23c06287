"""The write path shared by the harmony formats of prepare-data (conversations, preference pairs).

`open_document_set` resolves the inputs, opens the checkpoint's tokenizer as a harmony tokenizer and
checks the outputs; `DocumentSet.streaming` gives a format's writer the temporary token and mask files
and the rows a batch at a time, and `DocumentSet.commit` writes the index and moves the set under its final names, the
header OUT.json last; `check_options` checks the options both take. A failure anywhere leaves the old set (or none) and no temporary file.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import numpy as np

from gptoss_cli import outputs
from gptoss_cli.data.harmony import ANALYSIS_MODES, ConversationError, HarmonyTokenizer
from gptoss_cli.data.prepare.text import DECODE_ERRORS, open_tokenizer, prepare_outputs
from gptoss_cli.data.rows import Row, iter_rows, resolve_inputs
from gptoss_cli.data.token_format import (
    INDEX_DTYPE, commit_token_set, document_file_paths, token_dtype_for, token_file_paths, token_header,
)
from gptoss_cli.errors import UsageError, file_system_error
from gptoss_cli.limits import INT32_MAX

ROW_ERRORS = DECODE_ERRORS + ("skip",)  # --errors: skip counts a row that does not parse and leaves it out


def check_options(analysis: str, errors: str, max_length: int | None, seq_length: int | None, *, least: int,
                  unit: str, why_least: str = "") -> int | None:
    """The options both harmony formats take, checked; the max length a `unit` (a conversation, a pair) may
    have: --max-length, else --seq-length (one longer than a row could never be trained whole)."""
    if analysis not in ANALYSIS_MODES:
        raise UsageError(f"--analysis {analysis!r} is not one of {', '.join(ANALYSIS_MODES)}")
    if errors not in ROW_ERRORS:
        raise UsageError(f"--errors {errors!r} is not one of {', '.join(ROW_ERRORS)}")
    for name, value in (("--max-length", max_length), ("--seq-length", seq_length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not least <= value <= INT32_MAX):
            raise UsageError(f"{name} {value!r} must be at least {least} tokens{why_least} and at most {INT32_MAX}")
    if max_length is None:
        return seq_length
    if seq_length is not None and max_length > seq_length:
        raise UsageError(f"--max-length {max_length} is longer than --seq-length {seq_length}: such {unit} would "
                         "fit no training row", hint="leave --max-length out, or make it at most --seq-length")
    return max_length


@dataclass
class DocumentSet:
    """One token set being written: its inputs, tokenizer, final paths and temporary files."""

    inputs: list[Path | str]
    files: list[Any]
    harmony_tok: HarmonyTokenizer
    tok_file: Path
    vocab_size: int
    dtype_name: str
    bin_path: Path
    header_path: Path
    idx_path: Path
    mask_path: Path

    def __post_init__(self) -> None:
        self.temps = [outputs.temp_path(p, outputs.TMP) for p in (self.bin_path, self.mask_path, self.idx_path)]

    @property
    def paths(self) -> list[str]:
        return [str(p) for p in (self.bin_path, self.idx_path, self.mask_path, self.header_path)]

    @property
    def sources(self) -> list[str]:
        return [str(p) for p in self.inputs]

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Temporary files removed on the way out; an OSError is one line naming OUT.bin."""
        try:
            yield
        except OSError as exc:
            raise file_system_error(exc, f"writing {self.bin_path} failed") from None
        finally:
            for tmp in self.temps:
                tmp.unlink(missing_ok=True)

    @contextmanager
    def streaming(self, errors: str, batch_rows: int, progress: Callable[[int, int], None] | None
                  ) -> Iterator[tuple[BinaryIO, BinaryIO, Iterator[list[Row]]]]:
        """The temporary token and mask files, open for appending, and the inputs' rows a batch at a time
        (progress in input bytes after each batch)."""
        tmp_bin, tmp_mask, _ = self.temps
        total_bytes = sum(f.path.stat().st_size for f in self.files)

        def batches() -> Iterator[list[Row]]:
            done_bytes = 0
            for rows in iter_rows(self.files, errors, batch_rows):
                yield rows
                done_bytes += sum(r.nbytes for r in rows)
                if progress:
                    progress(min(done_bytes, total_bytes), total_bytes)

        with outputs.naming(tmp_bin), tmp_bin.open("wb") as fb, tmp_mask.open("wb") as fm:
            yield fb, fm, batches()

    def commit(self, offsets: list[int], documents: dict[str, Any]) -> None:
        """Write the index, then move tokens, mask and index under their final names and the header last."""
        tmp_bin, tmp_mask, tmp_idx = self.temps
        header = token_header(dtype=self.dtype_name, num_tokens=offsets[-1], num_documents=len(offsets) - 1,
                              vocab_size=self.vocab_size, eos_token_id=None, tokenizer=str(self.tok_file),
                              sources=self.sources, documents=documents)
        with outputs.naming(self.idx_path):
            tmp_idx.write_bytes(np.asarray(offsets, dtype=INDEX_DTYPE).tobytes())
        commit_token_set([(tmp_bin, self.bin_path), (tmp_mask, self.mask_path), (tmp_idx, self.idx_path)],
                         self.header_path, header)


def open_document_set(inputs: list[Path | str], out: Path, tokenizer: Path, split: str | None) -> DocumentSet:
    """Resolve the inputs, open the harmony tokenizer and check OUT's files may be written."""
    files = resolve_inputs(list(inputs), split)
    tok, tok_file = open_tokenizer(tokenizer)
    try:
        harmony_tok = HarmonyTokenizer(tok, str(tok_file))
    except ConversationError as exc:
        raise UsageError(str(exc), hint="use the checkpoint's own tokenizer.json") from None
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    bin_path, header_path = token_file_paths(out)
    idx_path, mask_path = document_file_paths(out)
    prepare_outputs(out, [bin_path, idx_path, mask_path, header_path], [f.path for f in files] + [tok_file])
    return DocumentSet(list(inputs), files, harmony_tok, tok_file, vocab_size, token_dtype_for(vocab_size),
                       bin_path, header_path, idx_path, mask_path)


__all__ = ["DocumentSet", "open_document_set", "check_options", "ROW_ERRORS"]
