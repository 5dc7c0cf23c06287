"""`prepare-data --format text` (the default): tokenize text or JSONL files into the token file format that
training memory-maps (version 1).

Streaming: documents are read and tokenized in batches and appended to `OUT.bin`; memory use
does not grow with the input. Each document's tokens are followed by the EOS id. The header
`OUT.json` is written last, and both files appear under their final names only when complete.
Format: gptoss_cli/data/token_format.py.

Inputs: `.jsonl` / `.json` lines files (one JSON object per line, the text under `text_key`), or
any other file as plain UTF-8 text where one or more blank lines separate documents. Invalid UTF-8
is an error naming the file and byte offset (`errors="replace"` substitutes U+FFFD instead, as an
explicit choice); a NUL byte marks a binary file, which is always refused.
"""

from __future__ import annotations

import array
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from gptoss_cli import outputs
from gptoss_cli.errors import ConfigError, UsageError, file_system_error
from gptoss_cli.data.conversation import MESSAGES_FIELD
from gptoss_cli.data.prepare.result import PrepareResult
from gptoss_cli.data.tokenizer import read_tokenizer, tokenizer_path
from gptoss_cli.json_input import jsonl_lines, parse_json
from gptoss_cli.data.token_format import (
    TOKEN_ITEMSIZE, commit_token_set, token_dtype_for, token_file_paths, token_header,
)

BATCH_DOCS = 512
DECODE_ERRORS = ("strict", "replace")
EOS_CANDIDATES = ("<|endoftext|>", "<|return|>", "</s>", "<eos>")


def _tokenizer_file(path: Path) -> Path:
    candidate = tokenizer_path(path)
    if not candidate.is_file():
        raise UsageError(f"tokenizer {candidate} not found", hint="pass a checkpoint folder with tokenizer.json, or the file")
    return candidate


def _eos_id(tokenizer: Any, tok_file: Path, eos_token_id: int | None, vocab_size: int) -> int:
    eos = _configured_eos(tokenizer, tok_file, eos_token_id)
    if isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < vocab_size:
        where = "--eos-id" if eos_token_id is not None else f"eos_token_id of {tok_file.parent / 'config.json'}"
        raise UsageError(
            f"{where} {eos!r} is outside the vocabulary of {tok_file} (ids 0..{vocab_size - 1})",
            hint="pass the id of the tokenizer's end-of-text token",
        )
    return eos


def _configured_eos(tokenizer: Any, tok_file: Path, eos_token_id: int | None) -> Any:
    if eos_token_id is not None:
        return eos_token_id
    config = tok_file.parent / "config.json"
    if config.is_file():
        try:
            data = parse_json(config.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            data = None
        eos = data.get("eos_token_id") if isinstance(data, dict) else None
        if isinstance(eos, list) and eos:
            eos = eos[0]
        if eos is not None:
            return eos
    for token in EOS_CANDIDATES:
        tid = tokenizer.token_to_id(token)
        if tid is not None:
            return tid
    raise ConfigError(
        f"{tok_file}: cannot tell the end-of-document token (no config.json eos_token_id, none of {list(EOS_CANDIDATES)})",
        hint="pass --eos-id N",
    )


def decode_line(raw: bytes, path: Path, offset: int, errors: str) -> str:
    """One line of input as text; binary data and (unless errors="replace") invalid UTF-8 are refused."""
    nul = raw.find(b"\0")
    if nul >= 0:
        raise UsageError(f"{path}: NUL byte at byte offset {offset + nul}; this looks like a binary file, not text")
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{path}: invalid UTF-8 at byte offset {offset + exc.start} ({exc.reason})",
            hint="fix the file, or pass --errors replace to substitute U+FFFD",
        ) from None


def line_decoder(path: Path, errors: str) -> Callable[[bytes, int, int], str]:
    """`decode_line` for the lines of `path`, in the form `jsonl_lines` takes."""
    return lambda raw, number, offset: decode_line(raw, path, offset, errors)


def _documents(path: Path, text_key: str, errors: str = "strict") -> Iterator[tuple[str, int]]:
    """(document text, bytes consumed) for one input file, streamed."""
    if path.suffix in (".jsonl", ".json"):
        for line in jsonl_lines(path, line_decoder(path, errors)):
            if line.blank:
                yield "", line.nbytes
                continue
            obj = line.value
            if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
                chat = isinstance(obj, dict) and isinstance(obj.get(MESSAGES_FIELD), list)
                raise UsageError(
                    f"{path}:{line.number}: no string field {text_key!r}"
                    + (f" (the line is a conversation: a {MESSAGES_FIELD!r} list)" if chat else ""),
                    hint=("pass --format harmony to render conversations with a loss mask on what the assistant "
                          "writes (docs/sft-data.md)" if chat else "pass --text-key with the field that holds the text"),
                )
            yield obj[text_key], line.nbytes
        return
    offset = 0
    lines: list[str] = []
    consumed = 0
    with path.open("rb") as fh:
        for raw in fh:
            line = decode_line(raw, path, offset, errors)
            offset += len(raw)
            consumed += len(raw)
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).rstrip("\n"), consumed
                lines, consumed = [], 0
    if lines or consumed:
        yield "".join(lines).rstrip("\n"), consumed


def check_inputs(inputs: list[Path]) -> None:
    """The input files exist and are files (UsageError naming the first that is not)."""
    if not inputs:
        raise UsageError("no input files given")
    for p in inputs:
        if Path(p).is_dir():
            raise UsageError(f"input {p} is a folder; pass the text or JSONL files in it")
        if not Path(p).is_file():
            raise UsageError(f"input file {p} not found")


def open_tokenizer(tokenizer: Path) -> tuple[Any, Path]:
    """(tokenizers.Tokenizer, its tokenizer.json path) for a tokenizer.json or a checkpoint folder holding it."""
    tok_file = _tokenizer_file(Path(tokenizer))
    return read_tokenizer(tok_file, "prepare-data"), tok_file


def prepare_outputs(out: Path, targets: list[Path], sources: list[Path]) -> None:
    """The output files can be written: none of them is a file the command reads (`sources`), no
    folder in their place, leftovers of killed runs removed, the folder made."""
    _check_not_overwritten(out, tuple(targets), sources)
    outputs.check_writable_location(targets[0], "--out")
    for target in targets:
        if target.is_dir():
            raise UsageError(f"--out {out}: {target} is a folder")
        outputs.recover(target)  # .OUT.bin.tmp-PID of killed runs
    try:
        targets[0].parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise file_system_error(exc, "cannot create the output folder") from None


def prepare_data(
    inputs: list[Path],
    out: Path,
    tokenizer: Path,
    *,
    text_key: str = "text",
    eos_token_id: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    errors: str = "strict",
) -> PrepareResult:
    """Tokenize `inputs` into OUT.bin + OUT.json; `progress(bytes_done, bytes_total)`.

    errors: "strict" (invalid UTF-8 is an error naming the file and byte offset) or "replace".
    """
    if errors not in DECODE_ERRORS:
        raise UsageError(f"--errors {errors!r} is not one of {', '.join(DECODE_ERRORS)}")
    if not isinstance(text_key, str) or not text_key:
        raise UsageError(f"--text-key {text_key!r} must be a non-empty field name")
    check_inputs(inputs)
    tok, tok_file = open_tokenizer(tokenizer)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos = _eos_id(tok, tok_file, eos_token_id, vocab_size)
    dtype_name = token_dtype_for(vocab_size)
    bin_path, header_path = token_file_paths(out)
    prepare_outputs(out, [bin_path, header_path], [*map(Path, inputs), tok_file])
    tmp = outputs.temp_path(bin_path, outputs.TMP)
    total_bytes = sum(Path(p).stat().st_size for p in inputs)
    done_bytes = num_tokens = num_docs = 0

    def flush(batch: list[str], fh: Any) -> int:
        encodings = tok.encode_batch(batch, add_special_tokens=False)
        ids: list[int] = []
        for enc in encodings:
            ids.extend(enc.ids)
            ids.append(eos)
        fh.write(to_bytes(ids, dtype_name))
        return len(ids)

    try:
        with tmp.open("wb") as fh:
            for path in inputs:
                batch: list[str] = []
                for text, nbytes in _documents(Path(path), text_key, errors):
                    done_bytes += nbytes
                    if text:
                        batch.append(text)
                        num_docs += 1
                    if len(batch) >= BATCH_DOCS:
                        num_tokens += flush(batch, fh)
                        batch = []
                        if progress:
                            progress(done_bytes, total_bytes)
                if batch:
                    num_tokens += flush(batch, fh)
                if progress:
                    progress(done_bytes, total_bytes)
        if num_docs == 0:
            raise UsageError(f"no documents found in {[str(p) for p in inputs]}")
        header = token_header(dtype=dtype_name, num_tokens=num_tokens, num_documents=num_docs,
                              vocab_size=vocab_size, eos_token_id=eos, tokenizer=str(tok_file),
                              sources=[str(p) for p in inputs])
        commit_token_set([(tmp, bin_path)], header_path, header)
    except OSError as exc:
        raise file_system_error(exc, f"writing {bin_path} failed") from None
    finally:
        tmp.unlink(missing_ok=True)
    return PrepareResult(
        "text", str(bin_path), str(header_path), [str(bin_path), str(header_path)], num_tokens, num_docs, dtype_name,
        vocab_size, [str(p) for p in inputs], details={"eos_token_id": eos},
        summary=[("documents", f"{num_docs:,}"), ("vocab / eos", f"{vocab_size} / {eos}")])


def _check_not_overwritten(out: Path, targets: tuple[Path, ...], sources: list[Path]) -> None:
    """--out may not name a file the command reads (OUT.bin / OUT.json being an input or the tokenizer)."""
    for target in targets:
        for source in sources:
            try:
                same = target.resolve() == source.resolve() or (target.exists() and os.path.samefile(target, source))
            except OSError:
                continue
            if same:
                raise UsageError(f"--out {out} would overwrite {source}, which this command reads",
                                 hint="choose another --out prefix")


def to_bytes(ids: list[int], dtype: str) -> bytes:
    """Little-endian bytes of the ids as the token format's unsigned `dtype` ("uint16"/"uint32"), without numpy or torch."""
    itemsize = TOKEN_ITEMSIZE[dtype]
    arr = array.array("H" if itemsize == 2 else "I", ids)
    if arr.itemsize != itemsize:  # pragma: no cover - exotic platforms
        arr = array.array("L" if itemsize == 4 else "H", ids)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


__all__ = ["prepare_data", "check_inputs", "decode_line", "line_decoder", "open_tokenizer", "prepare_outputs",
           "to_bytes"]
