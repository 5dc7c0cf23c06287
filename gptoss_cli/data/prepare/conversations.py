"""`prepare-data --format harmony`: render conversations into a version-2 token file (tokens, index, loss mask).

Each row (a non-blank JSONL line, a Parquet or Arrow row: data/rows.py) is one conversation
(harmony's `Conversation.to_json()` form or the Hugging Face chat form, data/conversation.py) and
becomes one document: its harmony tokens and, per token, whether it is a trained target. Streaming:
rows are rendered a batch at a time (one tokenizer call per batch) and tokens and mask appended to
temporary files; the index (8 bytes per document) is kept in memory. A row that does not parse is
an error naming its file and row, or with errors="skip" counted and left out. Nothing appears under
the final names unless every row rendered (or was skipped); the header OUT.json is written last.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from gptoss_cli.data.conversation import MESSAGES_FIELD, conversation_from_row, parse_conversation
from gptoss_cli.data.harmony import TRAIN_ON, ConversationError, HarmonyTokenizer, render_many
from gptoss_cli.data.rows import BATCH_ROWS, Row
from gptoss_cli.data.packing import pack_documents, packing_efficiency
from gptoss_cli.data.prepare.document_set import check_options, open_document_set
from gptoss_cli.data.prepare.result import PrepareResult
from gptoss_cli.errors import UsageError
from gptoss_cli.data.prepare.text import to_bytes

MAX_REPORTED = 20  # skipped rows named in the result (all are counted)


def _check_options(analysis: str, train_on: str, max_length: int | None, truncate: bool, seq_length: int | None,
                   errors: str) -> int | None:
    if train_on not in TRAIN_ON:
        raise UsageError(f"--train-on {train_on!r} is not one of {', '.join(TRAIN_ON)}")
    max_length = check_options(analysis, errors, max_length, seq_length, least=2, unit="conversations")
    if truncate and max_length is None:
        raise UsageError("--truncate needs --max-length (or --seq-length) to say where to cut")
    return max_length


# Why a conversation was dropped (the --json `dropped` keys), each with the rows it names.
TOO_LONG = "longer_than_max_length"  # without --truncate
NOTHING_TRAINED = "no_trained_token_before_the_cut"  # with --truncate: the cut would train nothing
MAX_DROPPED_ROWS = 5  # dropped rows named per reason (all are counted)


class _Writer:
    """Appends rendered documents to the temporary token and mask files; counts what it keeps and drops."""

    def __init__(self, fb: Any, fm: Any, dtype: str, max_length: int | None, truncate: bool, errors: str):
        self.fb, self.fm, self.dtype, self.max_length, self.truncate, self.errors = fb, fm, dtype, max_length, truncate, errors
        self.offsets, self.lengths = [0], []
        self.num_loss = self.num_dropped = self.num_truncated = self.num_skipped = 0
        self.skipped: list[str] = []
        # per reason: {"count", "rows" (the first few: where, tokens, first trained token), "longest", "first_trained"}
        self.dropped: dict[str, dict[str, Any]] = {}

    def drop(self, reason: str, where: str, ids: list[int], mask: list[int]) -> None:
        first = next((i for i, m in enumerate(mask) if m), None)
        entry = self.dropped.setdefault(reason, {"count": 0, "rows": [], "longest": 0, "first_trained": 0})
        entry["count"] += 1
        entry["longest"] = max(entry["longest"], len(ids))
        entry["first_trained"] = max(entry["first_trained"], first if first is not None else 0)
        if len(entry["rows"]) < MAX_DROPPED_ROWS:
            entry["rows"].append({"row": where, "tokens": len(ids), "first_trained_token": first})
        self.num_dropped += 1

    def skip(self, where: str, why: str) -> None:
        if self.errors != "skip":
            raise UsageError(f"{where}: {why}",
                             hint="fix the row, or pass --errors skip to leave such rows out (and count them)")
        self.num_skipped += 1
        if len(self.skipped) < MAX_REPORTED:
            self.skipped.append(f"{where}: {why}")

    def add(self, where: str, ids: list[int], mask: list[int]) -> None:
        if self.max_length is not None and len(ids) > self.max_length:
            if not self.truncate or not any(mask[:self.max_length]):
                self.drop(NOTHING_TRAINED if self.truncate else TOO_LONG, where, ids, mask)
                return
            ids, mask = ids[:self.max_length], mask[:self.max_length]
            self.num_truncated += 1
        self.fb.write(to_bytes(ids, self.dtype))
        self.fm.write(bytes(mask))
        self.lengths.append(len(ids))
        self.offsets.append(self.offsets[-1] + len(ids))
        self.num_loss += sum(mask)

    def batch(self, rows: list[Row], harmony_tok: HarmonyTokenizer, field_name: str, analysis: str,
              train_on: str) -> None:
        parsed: list[tuple[str, Any]] = []
        for row in rows:
            if row.error is not None:
                self.skip(row.where, row.error)
            elif row.value is not None:
                try:
                    parsed.append((row.where, parse_conversation(conversation_from_row(row.value, field_name))))
                except ConversationError as exc:
                    self.skip(row.where, str(exc))
        rendered = render_many([m for _, m in parsed], harmony_tok, analysis=analysis, train_on=train_on)
        for (where, _), doc in zip(parsed, rendered):
            if isinstance(doc, ConversationError):
                self.skip(where, str(doc))
            else:
                self.add(where, doc.ids, doc.mask)


def prepare_conversations(
    inputs: list[Path | str],
    out: Path,
    tokenizer: Path,
    *,
    analysis: str = "keep",
    train_on: str = "last",
    max_length: int | None = None,
    truncate: bool = False,
    seq_length: int | None = None,
    errors: str = "strict",
    split: str | None = None,
    field_name: str = MESSAGES_FIELD,
    batch_rows: int = BATCH_ROWS,
    progress: Callable[[int, int], None] | None = None,
) -> PrepareResult:
    """Render the conversations of `inputs` (JSONL or Parquet files, dataset folders, dataset ids in the Hub
    cache; data/rows.py) into OUT.bin, OUT.idx, OUT.mask and OUT.json (version 2).

    max_length: longer conversations are dropped and counted, or cut to it with `truncate` (a cut
    conversation with no trained token left is dropped); defaults to seq_length. seq_length: the
    training row length the packing report is for (recorded in the header). errors: strict, replace
    (invalid UTF-8 as U+FFFD) or skip (rows that do not parse are counted and left out). field_name: the
    column holding the messages (data/conversation.py's conversation_from_row).
    """
    max_length = _check_options(analysis, train_on, max_length, truncate, seq_length, errors)
    if not field_name:
        raise UsageError("--field must name the column that holds the messages")
    docs = open_document_set(inputs, out, tokenizer, split)
    rendering = {"analysis": analysis, "train_on": train_on, "max_length": max_length, "truncate": truncate}
    with docs.writing():
        with docs.streaming(errors, batch_rows, progress) as (fb, fm, batches):
            w = _Writer(fb, fm, docs.dtype_name, max_length, truncate, errors)
            for rows in batches:
                w.batch(rows, docs.harmony_tok, field_name, analysis, train_on)
        lengths = w.lengths
        if not lengths:
            names = [str(p) for p in inputs]
            if w.num_dropped:
                reason, fix = _drop_lines(w, max_length, seq_length)[0]
                raise UsageError(f"all {w.num_dropped} conversations in {names} were dropped: {reason}", hint=fix)
            raise UsageError(f"no conversations found in {names}"
                             + (f" ({w.num_skipped} rows skipped: {w.skipped[0]})" if w.num_skipped else ""))
        packing = None
        if seq_length is not None:
            rows_ = pack_documents(lengths, seq_length)  # every length <= max_length <= seq_length
            packing = {"seq_length": seq_length, "rows": len(rows_),
                       "efficiency": round(packing_efficiency(lengths, rows_, seq_length), 6)}
        documents = {"loss_mask": True, "kind": "harmony", "num_loss_tokens": w.num_loss,
                     "max_document_length": max(lengths), "num_dropped": w.num_dropped,
                     "num_skipped": w.num_skipped, "rendering": rendering, "packing": packing}
        docs.commit(w.offsets, documents)
    details = {"index_path": str(docs.idx_path), "mask_path": str(docs.mask_path), "num_loss_tokens": w.num_loss,
               # num_dropped: longer than max_length (without truncate), or nothing trained left after truncating
               "num_dropped": w.num_dropped, "num_truncated": w.num_truncated, "max_document_length": max(lengths),
               # why, per reason: {"count", "rows": the first few {"row", "tokens", "first_trained_token"}}
               "dropped": {k: {"count": v["count"], "rows": v["rows"]} for k, v in w.dropped.items()},
               "rendering": rendering, "packing": packing}  # packing: {"seq_length", "rows", "efficiency"} or None
    return PrepareResult(
        "harmony", str(docs.bin_path), str(docs.header_path), docs.paths, w.offsets[-1], len(lengths),
        docs.dtype_name, docs.vocab_size, docs.sources, details=details,
        summary=_summary(w, len(lengths), max(lengths), rendering, packing, seq_length), num_skipped=w.num_skipped,
        skipped=w.skipped)


def _drop_lines(w: _Writer, max_length: int, seq_length: int | None) -> list[tuple[str, str]]:
    """(why, with the count and the first rows; the fix) per reason conversations were dropped."""
    flag = f"--max-length {max_length}" if seq_length is None or max_length != seq_length else f"--seq-length {seq_length}"
    out = []
    for reason, entry in w.dropped.items():
        n, more = entry["count"], entry["count"] - len(entry["rows"])
        if reason == TOO_LONG:
            why = f"longer than {flag}"
            rows = [f"{r['row']} ({r['tokens']} tokens)" for r in entry["rows"]]
            fix = (f"a {flag.split()[0]} of at least {entry['longest']} keeps them whole, or --truncate cuts them "
                   "there (keeping those with a trained token before the cut)")
        else:
            why = f"no trained token in their first {max_length} tokens, where --truncate cuts"
            rows = [f"{r['row']} (first trained token at {r['first_trained_token']} of {r['tokens']})"
                    for r in entry["rows"]]
            fix = (f"a {flag.split()[0]} of at least {entry['longest']} keeps them whole, "
                   f"{entry['first_trained'] + 1} a trained token of each: --truncate keeps a conversation's start "
                   "(system message, tool definitions, the prompt) and the trained turns come last")
        shown = ", ".join(rows) + (f" and {more:,} more" if more else "")
        out.append((f"{n:,} {why}: {shown}", fix))
    return out


def _summary(w: _Writer, documents: int, longest: int, rendering: dict[str, Any], packing: dict[str, Any] | None,
             seq_length: int | None = None) -> list[tuple[str, str]]:
    num_tokens = w.offsets[-1]
    rows = [("conversations", f"{documents:,} (longest {longest:,} tokens)"),
            ("trained tokens", f"{w.num_loss:,} ({w.num_loss / num_tokens:.1%})"),
            ("dropped / truncated", f"{w.num_dropped:,} / {w.num_truncated:,} "
                                    f"(max length {rendering['max_length'] or 'none'})")]
    rows += [("dropped", f"{why} ({fix})") for why, fix in _drop_lines(w, rendering["max_length"], seq_length)]
    if w.num_skipped:
        rows.append(("skipped rows", f"{w.num_skipped:,} (--errors skip)"))
    rows.append(("rendering", f"analysis {rendering['analysis']}, train on {rendering['train_on']}"))
    if packing:
        rows.append(("packing", f"{packing['efficiency']:.2%} of {packing['rows']:,} rows of {packing['seq_length']:,} tokens"))
    return rows


__all__ = ["prepare_conversations"]
