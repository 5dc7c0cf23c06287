"""`prepare-data --format preference`: render preference pairs into a version-2 token file of paired documents.

Each row (data/rows.py: a JSONL line, a Parquet or Arrow row, from files, dataset folders or Hub-cache ids)
is a pair (data/preference.py) and becomes two documents, the chosen side then the rejected side, each
with its loss mask on what the assistant writes: documents 2i and 2i+1 are pair i. The header says
`"kind": "preference"` (data/token_format.py), which is what makes training read the file as pairs
(gptoss_cli/preference/data.py): a pair is packed into one row as a unit, so both sides always sit in the
same microbatch on the same rank. --max-length bounds a pair (both sides together, what one row must hold);
a longer pair is dropped and counted, never cut. A row that does not parse or fails a pair check is an
error naming its file and row, or with errors="skip" counted and left out. Nothing appears under the final
names unless every row rendered (or was skipped); the header OUT.json is written last.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from gptoss_cli.data.harmony import ConversationError, HarmonyTokenizer
from gptoss_cli.data.packing import pack_documents, packing_efficiency
from gptoss_cli.data.preference import PREFERENCE_KIND, parse_pair, render_pairs
from gptoss_cli.data.prepare.document_set import check_options, open_document_set
from gptoss_cli.data.prepare.result import PrepareResult
from gptoss_cli.data.prepare.text import to_bytes
from gptoss_cli.data.rows import BATCH_ROWS, Row
from gptoss_cli.errors import UsageError

MAX_REPORTED = 20


class _PairWriter:
    """Appends both sides of each pair to the temporary token and mask files; counts what it keeps and drops."""

    def __init__(self, fb: Any, fm: Any, dtype: str, max_length: int | None, errors: str):
        self.fb, self.fm, self.dtype, self.max_length, self.errors = fb, fm, dtype, max_length, errors
        self.offsets, self.pair_lengths = [0], []
        self.num_loss = self.num_dropped = self.num_skipped = 0
        self.skipped: list[str] = []

    def skip(self, where: str, why: str) -> None:
        if self.errors != "skip":
            raise UsageError(f"{where}: {why}",
                             hint="fix the row, or pass --errors skip to leave such rows out (and count them)")
        self.num_skipped += 1
        if len(self.skipped) < MAX_REPORTED:
            self.skipped.append(f"{where}: {why}")

    def batch(self, rows: list[Row], tok: HarmonyTokenizer, analysis: str) -> None:
        parsed = []
        for row in rows:
            if row.error is not None:
                self.skip(row.where, row.error)
            elif row.value is not None:
                try:
                    parsed.append((row.where, parse_pair(row.value)))
                except ConversationError as exc:
                    self.skip(row.where, str(exc))
        for (where, _), pair in zip(parsed, render_pairs([p for _, p in parsed], tok, analysis=analysis)):
            if isinstance(pair, ConversationError):
                self.skip(where, str(pair))
                continue
            n = len(pair.chosen.ids) + len(pair.rejected.ids)
            if self.max_length is not None and n > self.max_length:
                self.num_dropped += 1
                continue
            for doc in (pair.chosen, pair.rejected):
                self.fb.write(to_bytes(doc.ids, self.dtype))
                self.fm.write(bytes(doc.mask))
                self.offsets.append(self.offsets[-1] + len(doc.ids))
                self.num_loss += sum(doc.mask)
            self.pair_lengths.append(n)


def _check_options(analysis: str, max_length: int | None, seq_length: int | None, errors: str) -> int | None:
    return check_options(analysis, errors, max_length, seq_length, least=4, unit="pairs",
                         why_least=" (two sides of two)")


def prepare_preference(
    inputs: list[Path | str],
    out: Path,
    tokenizer: Path,
    *,
    analysis: str = "keep",
    max_length: int | None = None,
    seq_length: int | None = None,
    errors: str = "strict",
    split: str | None = None,
    batch_rows: int = BATCH_ROWS,
    progress: Callable[[int, int], None] | None = None,
) -> PrepareResult:
    """Render the pairs of `inputs` into OUT.bin, OUT.idx, OUT.mask and OUT.json (version 2, kind preference).

    max_length: pairs whose two sides together are longer are dropped and counted; defaults to seq_length,
    the training row length the packing report is for. errors: strict, replace (invalid UTF-8 as U+FFFD)
    or skip (rows that do not parse or fail a pair check are counted and left out)."""
    max_length = _check_options(analysis, max_length, seq_length, errors)
    docs = open_document_set(inputs, out, tokenizer, split)
    rendering = {"analysis": analysis, "train_on": "last", "max_length": max_length}
    with docs.writing():
        with docs.streaming(errors, batch_rows, progress) as (fb, fm, batches):
            w = _PairWriter(fb, fm, docs.dtype_name, max_length, errors)
            for rows in batches:
                w.batch(rows, docs.harmony_tok, analysis)
        if not w.pair_lengths:
            names = [str(p) for p in inputs]
            if w.num_dropped:
                raise UsageError(f"all {w.num_dropped} pairs in {names} are longer than --max-length {max_length} "
                                 "(both sides together)", hint="raise --max-length / --seq-length")
            raise UsageError(f"no preference pairs found in {names}"
                             + (f" ({w.num_skipped} rows skipped: {w.skipped[0]})" if w.num_skipped else ""))
        packing = None
        if seq_length is not None:
            rows_ = pack_documents(w.pair_lengths, seq_length)
            packing = {"seq_length": seq_length, "rows": len(rows_),
                       "efficiency": round(packing_efficiency(w.pair_lengths, rows_, seq_length), 6)}
        lengths = np.diff(np.asarray(w.offsets))
        documents = {"loss_mask": True, "kind": PREFERENCE_KIND, "num_loss_tokens": w.num_loss,
                     "max_document_length": int(lengths.max()), "num_dropped": w.num_dropped,
                     "num_skipped": w.num_skipped, "rendering": rendering, "packing": packing}
        docs.commit(w.offsets, documents)
    details = {"index_path": str(docs.idx_path), "mask_path": str(docs.mask_path), "num_pairs": len(w.pair_lengths),
               "num_loss_tokens": w.num_loss, "num_dropped": w.num_dropped, "max_pair_length": max(w.pair_lengths),
               "rendering": rendering, "packing": packing}
    return PrepareResult(
        "preference", str(docs.bin_path), str(docs.header_path), docs.paths, w.offsets[-1], len(w.offsets) - 1,
        docs.dtype_name, docs.vocab_size, docs.sources, details=details,
        summary=_summary(w, rendering, packing), num_skipped=w.num_skipped, skipped=w.skipped)


def _summary(w: _PairWriter, rendering: dict[str, Any], packing: dict[str, Any] | None) -> list[tuple[str, str]]:
    rows = [("pairs", f"{len(w.pair_lengths):,} (longest {max(w.pair_lengths):,} tokens, both sides)"),
            ("trained tokens", f"{w.num_loss:,} ({w.num_loss / w.offsets[-1]:.1%})"),
            ("dropped", f"{w.num_dropped:,} (max length {rendering['max_length'] or 'none'}, both sides)")]
    if w.num_skipped:
        rows.append(("skipped rows", f"{w.num_skipped:,} (--errors skip)"))
    rows.append(("rendering", f"analysis {rendering['analysis']}, the reply after the prompt trained"))
    if packing:
        rows.append(("packing", f"{packing['efficiency']:.2%} of {packing['rows']:,} rows of "
                                f"{packing['seq_length']:,} tokens, a pair at a time"))
    return rows


__all__ = ["prepare_preference"]
