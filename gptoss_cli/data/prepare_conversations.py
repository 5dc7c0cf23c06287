"""`prepare-data --format harmony`: render JSONL conversations into a version-2 token file (tokens, index, loss mask).

Each non-blank JSONL line is one conversation (harmony's `Conversation.to_json()` form or the
Hugging Face chat form, gptoss_cli/data/harmony.py) and becomes one document: its harmony tokens
and, per token, whether it is a trained target. Streaming: tokens and mask are appended to
temporary files; the index (8 bytes per document) is kept in memory. Nothing appears under the
final names unless every line rendered; the header OUT.json is written last.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gptoss_cli.json_input import jsonl_lines
from gptoss_cli import outputs
from gptoss_cli.data.harmony import (
    ANALYSIS_MODES, TRAIN_ON, ConversationError, HarmonyTokenizer, parse_conversation, render_for_training,
)
from gptoss_cli.data.packing import pack_documents, packing_efficiency
from gptoss_cli.errors import UsageError, file_system_error
from gptoss_cli.data.token_format import (
    document_file_paths, token_dtype_for, token_file_paths, write_document_index, write_token_header,
)
from gptoss_cli.data.prepare_text import (
    DECODE_ERRORS, check_inputs, line_decoder, open_tokenizer, prepare_outputs, to_bytes,
)


@dataclass
class PrepareConversationsResult:
    bin_path: str
    header_path: str
    index_path: str
    mask_path: str
    num_tokens: int
    num_documents: int
    num_loss_tokens: int
    num_dropped: int  # longer than max_length (without --truncate), or nothing trained left after truncating
    num_truncated: int
    max_document_length: int
    dtype: str
    vocab_size: int
    rendering: dict[str, Any]
    packing: dict[str, Any] | None  # {"seq_length", "rows", "efficiency"} when seq_length was given
    sources: list[str] = field(default_factory=list)


INT32_MAX = 2**31 - 1  # training.seq_length's bound (recipe/schema.py): a row is a tensor dimension


def _check_options(analysis: str, train_on: str, max_length: int | None, truncate: bool, seq_length: int | None,
                   errors: str) -> int | None:
    if analysis not in ANALYSIS_MODES:
        raise UsageError(f"--analysis {analysis!r} is not one of {', '.join(ANALYSIS_MODES)}")
    if train_on not in TRAIN_ON:
        raise UsageError(f"--train-on {train_on!r} is not one of {', '.join(TRAIN_ON)}")
    if errors not in DECODE_ERRORS:
        raise UsageError(f"--errors {errors!r} is not one of {', '.join(DECODE_ERRORS)}")
    for name, value in (("--max-length", max_length), ("--seq-length", seq_length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= INT32_MAX):
            raise UsageError(f"{name} {value!r} must be at least 2 tokens and at most {INT32_MAX}")
    if max_length is None:
        max_length = seq_length  # a conversation longer than a row could never be trained whole
    if seq_length is not None and max_length > seq_length:
        raise UsageError(f"--max-length {max_length} is longer than --seq-length {seq_length}: such conversations "
                         "would fit no training row", hint="leave --max-length out, or make it at most --seq-length")
    if truncate and max_length is None:
        raise UsageError("--truncate needs --max-length (or --seq-length) to say where to cut")
    return max_length


def prepare_conversations(
    inputs: list[Path],
    out: Path,
    tokenizer: Path,
    *,
    analysis: str = "keep",
    train_on: str = "last",
    max_length: int | None = None,
    truncate: bool = False,
    seq_length: int | None = None,
    errors: str = "strict",
    progress: Callable[[int, int], None] | None = None,
) -> PrepareConversationsResult:
    """Render the conversations of `inputs` into OUT.bin, OUT.idx, OUT.mask and OUT.json (version 2).

    max_length: longer conversations are dropped and counted, or cut to it with `truncate` (a cut
    conversation with no trained token left is dropped); defaults to seq_length. seq_length: the
    training row length the packing report is for (recorded in the header).
    """
    max_length = _check_options(analysis, train_on, max_length, truncate, seq_length, errors)
    check_inputs(inputs)
    tok, tok_file = open_tokenizer(tokenizer)
    try:
        harmony_tok = HarmonyTokenizer(tok, str(tok_file))
    except ConversationError as exc:
        raise UsageError(str(exc), hint="use the checkpoint's own tokenizer.json") from None
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    dtype_name = token_dtype_for(vocab_size)
    bin_path, header_path = token_file_paths(out)
    idx_path, mask_path = document_file_paths(out)
    prepare_outputs(out, [bin_path, idx_path, mask_path, header_path], [*map(Path, inputs), tok_file])
    tmp_bin, tmp_mask = outputs.temp_path(bin_path, outputs.TMP), outputs.temp_path(mask_path, outputs.TMP)
    total_bytes = sum(Path(p).stat().st_size for p in inputs)
    done_bytes = 0
    offsets, lengths = [0], []
    num_loss = num_dropped = num_truncated = 0
    rendering = {"analysis": analysis, "train_on": train_on, "max_length": max_length, "truncate": truncate}
    try:
        with outputs.naming(tmp_bin), tmp_bin.open("wb") as fb, tmp_mask.open("wb") as fm:
            for path in map(Path, inputs):
                for line in jsonl_lines(path, line_decoder(path, errors), not_json="not JSON"):
                    done_bytes += line.nbytes
                    if line.blank:
                        continue
                    try:
                        doc = render_for_training(parse_conversation(line.value), harmony_tok, analysis=analysis,
                                                  train_on=train_on)
                    except ConversationError as exc:
                        raise UsageError(f"{path}:{line.number}: {exc}") from None
                    ids, mask = doc.ids, doc.mask
                    if max_length is not None and len(ids) > max_length:
                        if not truncate or not any(mask[:max_length]):
                            num_dropped += 1
                            continue
                        ids, mask = ids[:max_length], mask[:max_length]
                        num_truncated += 1
                    fb.write(to_bytes(ids, dtype_name))
                    fm.write(bytes(mask))
                    lengths.append(len(ids))
                    offsets.append(offsets[-1] + len(ids))
                    num_loss += sum(mask)
                    if progress and len(lengths) % 256 == 0:
                        progress(done_bytes, total_bytes)
            if progress:
                progress(done_bytes, total_bytes)
        if not lengths:
            names = [str(p) for p in inputs]
            if num_dropped:
                raise UsageError(f"all {num_dropped} conversations in {names} are longer than --max-length {max_length}",
                                 hint="raise --max-length / --seq-length, or pass --truncate")
            raise UsageError(f"no conversations found in {names}")
        packing = None
        if seq_length is not None:
            rows = pack_documents(lengths, seq_length)  # every length <= max_length <= seq_length
            packing = {"seq_length": seq_length, "rows": len(rows),
                       "efficiency": round(packing_efficiency(lengths, rows, seq_length), 6)}
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_mask, mask_path)
        write_document_index(idx_path, offsets)
    except OSError as exc:
        raise file_system_error(exc, f"writing {bin_path} failed") from None
    finally:
        tmp_bin.unlink(missing_ok=True)
        tmp_mask.unlink(missing_ok=True)
    documents = {"loss_mask": True, "kind": "harmony", "num_loss_tokens": num_loss,
                 "max_document_length": max(lengths), "num_dropped": num_dropped, "rendering": rendering,
                 "packing": packing}
    sources = [str(p) for p in inputs]
    write_token_header(header_path, dtype=dtype_name, num_tokens=offsets[-1], num_documents=len(lengths),
                       vocab_size=vocab_size, eos_token_id=None, tokenizer=str(tok_file), sources=sources,
                       documents=documents)
    return PrepareConversationsResult(
        str(bin_path), str(header_path), str(idx_path), str(mask_path), offsets[-1], len(lengths), num_loss,
        num_dropped, num_truncated, max(lengths), dtype_name, vocab_size, rendering, packing, sources)


__all__ = ["prepare_conversations", "PrepareConversationsResult"]
