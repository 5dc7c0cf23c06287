"""The token file format: what `gptoss prepare-data` writes and training memory-maps (no torch here).

For a prefix OUT:
  OUT.bin   the tokens of all documents back to back, each document followed by the EOS id,
            as raw little-endian unsigned integers (uint16 when the vocabulary fits, else uint32);
  OUT.json  the header: {"format": "gptoss-tokens", "version": 1, "dtype": "uint16"|"uint32",
            "num_tokens": N, "num_documents": D, "vocab_size": V, "eos_token_id": id,
            "tokenizer": path, "sources": [...]}.
Sample i of a file is the window tokens[i*S : i*S + S + 1] (inputs = first S, labels = last S), so
a file of N tokens holds (N - 1) // S samples.

Version 2 (`prepare-data --format harmony`: conversations with a loss mask) adds, for D documents:
  OUT.bin   the documents back to back with no EOS appended (a rendered conversation ends with its
            own stop token);
  OUT.idx   little-endian int64, D+1 document start offsets 0, ..., num_tokens, strictly increasing,
            every document at least 2 tokens long;
  OUT.mask  (when the header says "loss_mask": true) uint8, one per token: 1 where the token is a
            trained target (predicted from the tokens before it in its document), else 0; the first
            token of every document is 0;
  OUT.json  the v1 header with "version": 2, "documents": true, "loss_mask", "kind" (e.g. "harmony"),
            "num_loss_tokens", "max_document_length", "num_dropped", "num_skipped" (rows --errors skip
            left out), "rendering" (the options used) and,
            when prepare-data was given --seq-length, "packing" ({"seq_length", "rows", "efficiency"}).
Documents are trained whole: packed into rows of seq_length (gptoss_cli/data/packing.py), never split.

Shared by prepare-data (writing), the training data loader (reading) and the recipe rule that
checks the files at launch, which must not need torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gptoss_cli import outputs
from gptoss_cli.allocation import claimed
from gptoss_cli.errors import ConfigError
from gptoss_cli.json_input import parse_json

TOKEN_FORMAT = "gptoss-tokens"
TOKEN_FORMAT_VERSION = 1  # plain token streams (what plain `prepare-data` writes)
DOCUMENTS_FORMAT_VERSION = 2  # documents with an index and an optional loss mask
TOKEN_FORMAT_VERSIONS = (TOKEN_FORMAT_VERSION, DOCUMENTS_FORMAT_VERSION)
INDEX_DTYPE = "<i8"  # OUT.idx: document start offsets
MASK_DTYPE = "u1"  # OUT.mask: one 0/1 byte per token
# the header fields a version-2 file adds (written by write_token_header's `documents=`)
DOCUMENT_FIELDS = ("documents", "loss_mask", "kind", "num_loss_tokens", "max_document_length", "num_dropped",
                   "num_skipped", "rendering", "packing")
# dtype name -> bytes per token; readers also accept the signed widths older tools wrote
TOKEN_ITEMSIZE = {"uint16": 2, "uint32": 4, "int32": 4, "int64": 8}


def token_dtype_for(vocab_size: int) -> str:
    """The narrowest unsigned width that holds every id of a `vocab_size` vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def token_file_paths(path: str | Path) -> tuple[Path, Path]:
    """(tokens .bin, header .json) for a prefix or any of the file's paths (.bin, .json, .idx, .mask)."""
    p = Path(path)
    if p.suffix in (".bin", ".json", ".idx", ".mask"):
        p = p.with_suffix("")
    return p.with_suffix(".bin"), p.with_suffix(".json")


def document_file_paths(path: str | Path) -> tuple[Path, Path]:
    """(document index .idx, loss mask .mask) of a version-2 token file, for a prefix or any of its paths."""
    p = Path(path)
    if p.suffix in (".bin", ".json", ".idx", ".mask"):
        p = p.with_suffix("")
    return p.with_suffix(".idx"), p.with_suffix(".mask")


def write_atomically(path: str | Path, data: bytes | np.ndarray) -> None:
    """Write bytes (or an array's raw bytes) under a temporary name, then rename into place."""
    outputs.replace_bytes(Path(path), data.tobytes() if isinstance(data, np.ndarray) else data)


def write_document_index(path: str | Path, offsets: Sequence[int] | np.ndarray) -> None:
    """Write OUT.idx (D+1 int64 start offsets) atomically; write the header after it."""
    idx_path, _ = document_file_paths(path)
    write_atomically(idx_path, np.asarray(offsets, dtype=INDEX_DTYPE))


def token_header(*, dtype: str, num_tokens: int, num_documents: int, vocab_size: int, eos_token_id: int | None,
                 tokenizer: str | None, sources: list[str], documents: dict[str, Any] | None = None) -> dict[str, Any]:
    """The header of a token file; `documents` (the DOCUMENT_FIELDS but "documents") makes it version 2."""
    header = {
        "format": TOKEN_FORMAT, "version": TOKEN_FORMAT_VERSION, "dtype": dtype, "num_tokens": num_tokens,
        "num_documents": num_documents, "vocab_size": vocab_size, "eos_token_id": eos_token_id,
        "tokenizer": tokenizer, "sources": list(sources),
    }
    if documents is not None:
        unknown = sorted(set(documents) - set(DOCUMENT_FIELDS[1:]))
        if unknown:
            raise ValueError(f"unknown version-2 header fields {unknown}")
        header.update(version=DOCUMENTS_FORMAT_VERSION, documents=True, **documents)
    return header


def _header_bytes(header: dict[str, Any]) -> bytes:
    return (json.dumps(header, indent=2) + "\n").encode()


def write_token_header(json_path: str | Path, **fields: Any) -> dict[str, Any]:
    """Write the header of a token file atomically (a temporary name, then a rename); returns it.
    Takes token_header's fields. A command writing a whole set uses commit_token_set instead."""
    header = token_header(**fields)
    write_atomically(json_path, _header_bytes(header))
    return header


def commit_token_set(parts: Sequence[tuple[Path, Path]], header_path: Path, header: dict[str, Any]) -> None:
    """Put a finished token set in place. `parts` are (temporary, final) pairs already written whole.
    The header is written beside them under its temporary name first (the disk can still fill there,
    and then nothing at the prefix has changed); then the previous set's header is removed, the parts
    are renamed, and the header is renamed last. A set at this prefix is therefore the old one whole,
    the new one whole, or, if the process dies between renames, one without a header (which readers
    refuse as incomplete): never the old parts under a new header or new parts under an old one."""
    header_path = Path(header_path)
    tmp = outputs.temp_path(header_path, outputs.TMP)
    try:
        with outputs.naming(header_path):
            tmp.write_bytes(_header_bytes(header))
            header_path.unlink(missing_ok=True)
            for staged, final in parts:
                os.replace(staged, final)
            os.replace(tmp, header_path)
    finally:
        tmp.unlink(missing_ok=True)


def read_token_header(path: str | Path) -> dict[str, Any]:
    """The checked header of a token file (ConfigError naming the file otherwise)."""
    _, json_path = token_file_paths(path)
    if not json_path.is_file():
        raise ConfigError(f"token file header {json_path} not found", hint="create the files with `gptoss prepare-data`")
    try:
        header = parse_json(json_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{json_path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{json_path}: not JSON (not UTF-8: {exc.reason})") from None
    if not isinstance(header, dict) or header.get("format") != TOKEN_FORMAT or not isinstance(header.get("dtype"), str) \
            or header["dtype"] not in TOKEN_ITEMSIZE:
        got = header if not isinstance(header, dict) else {k: header.get(k) for k in ("format", "dtype")}
        raise ConfigError(f"{json_path}: not a gptoss token header ({got})",
                          hint="create the files with `gptoss prepare-data`")
    version = header.get("version", TOKEN_FORMAT_VERSION)
    if version not in TOKEN_FORMAT_VERSIONS or isinstance(version, bool):
        raise ConfigError(f"{json_path}: token format version {version!r} is not one this gptoss reads "
                          f"({', '.join(map(str, TOKEN_FORMAT_VERSIONS))})", hint="upgrade gptoss, or re-create the files")
    for field in ("vocab_size", "eos_token_id", "num_tokens"):
        value = header.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"{json_path}: {field}={value!r} is not a token count/id")
    if version == DOCUMENTS_FORMAT_VERSION:
        if header.get("documents") is not True or not isinstance(header.get("loss_mask"), bool):
            got = {k: header.get(k) for k in ("documents", "loss_mask")}
            raise ConfigError(f"{json_path}: a version-2 header needs \"documents\": true and a boolean "
                              f"\"loss_mask\" ({got})", hint="re-create the files with `gptoss prepare-data`")
        for field in ("num_documents", "num_tokens"):
            value = header.get(field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{json_path}: {field}={value!r} is not a positive count")
    return header


def has_documents(header: dict[str, Any]) -> bool:
    """Whether a (checked) header describes a version-2 file of documents (index, maybe a mask)."""
    return header.get("version", TOKEN_FORMAT_VERSION) == DOCUMENTS_FORMAT_VERSION


def _memmap(path: Path, dtype: str, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def read_document_offsets(idx_path: str | Path) -> np.ndarray:
    """OUT.idx as int64 offsets in memory; a file larger than this machine could hold (a sparse one whose
    header claims billions of documents) is one line naming it, never an allocator's traceback."""
    size = Path(idx_path).stat().st_size
    return claimed(f"{idx_path}: document index", size,
                   lambda: np.fromfile(idx_path, dtype=INDEX_DTYPE).astype(np.int64), idx_path)


def check_document_files(path: str | Path, header: dict[str, Any], num_tokens: int) -> np.ndarray:
    """The document start offsets of a version-2 file, after checking OUT.idx (D+1 strictly increasing
    offsets from 0 to num_tokens, every document at least 2 tokens) and, when the header announces
    a loss mask, OUT.mask (one 0/1 byte per token, 0 on the first token of every document);
    ConfigError naming the file, entry and value otherwise."""
    idx_path, mask_path = document_file_paths(path)
    hint = "re-create the files with `gptoss prepare-data`"
    if not idx_path.is_file():
        raise ConfigError(f"document index {idx_path} not found", hint=hint)
    num_docs = header["num_documents"]
    size = idx_path.stat().st_size
    if size != 8 * (num_docs + 1):
        raise ConfigError(f"{idx_path}: {size} bytes do not hold the {num_docs + 1} int64 offsets of the "
                          f"{num_docs} documents the header announces", hint=hint)
    offsets = read_document_offsets(idx_path)
    if offsets[0] != 0 or offsets[-1] != num_tokens:
        raise ConfigError(f"{idx_path}: offsets run from {int(offsets[0])} to {int(offsets[-1])}, not from 0 to "
                          f"num_tokens={num_tokens}", hint=hint)
    lengths = np.diff(offsets)
    short = np.flatnonzero(lengths < 2)
    if short.size:
        d = int(short[0])
        raise ConfigError(f"{idx_path}: document {d} has {int(lengths[d])} tokens (offsets {int(offsets[d])} -> "
                          f"{int(offsets[d + 1])}); every document needs at least 2 and offsets must increase",
                          hint=hint)
    if header.get("loss_mask"):
        if not mask_path.is_file():
            raise ConfigError(f"loss mask {mask_path} not found (the header says \"loss_mask\": true)", hint=hint)
        size = mask_path.stat().st_size
        if size != num_tokens:
            raise ConfigError(f"{mask_path}: {size} bytes, not one per token ({num_tokens})", hint=hint)
        mask = _memmap(mask_path, MASK_DTYPE, num_tokens)
        chunk = 1 << 26
        for start in range(0, num_tokens, chunk):
            bad = np.flatnonzero(mask[start:start + chunk] > 1)
            if bad.size:
                k = start + int(bad[0])
                raise ConfigError(f"{mask_path}: value {int(mask[k])} at token {k} is not 0 or 1", hint=hint)
        firsts = np.flatnonzero(mask[offsets[:-1]])
        if firsts.size:
            d = int(firsts[0])
            raise ConfigError(f"{mask_path}: the first token of document {d} (token {int(offsets[d])}) is marked "
                              f"trained; it has no tokens before it to be predicted from", hint=hint)
        del mask
    return offsets


def check_header_fits_model(header: dict[str, Any], json_path: Path, vocab_size: int) -> None:
    """The file's vocabulary and EOS id must lie inside the model's vocabulary."""
    hv, eos = header.get("vocab_size"), header.get("eos_token_id")
    if hv is not None and hv > vocab_size:
        raise ConfigError(
            f"{json_path}: tokenizer vocabulary {hv} exceeds the model's vocab_size {vocab_size}",
            hint="tokenize with the model's own tokenizer.json",
        )
    if eos is not None and eos >= vocab_size:
        raise ConfigError(f"{json_path}: eos_token_id {eos} is outside the model's vocabulary ({vocab_size})",
                          hint="re-create the files with `gptoss prepare-data` and the model's tokenizer")


def check_token_files(path: str | Path, vocab_size: int | None) -> tuple[Path, Path, dict[str, Any], int]:
    """(bin path, header path, header, number of tokens) of a token file whose header is valid, whose
    .bin exists and holds exactly the announced tokens, and (when `vocab_size` is given) whose
    vocabulary and EOS id fit the model; ConfigError naming the file otherwise.

    The one check of the files, shared by the launch-time recipe rule and the training data loader.
    """
    bin_path, json_path = token_file_paths(path)
    header = read_token_header(path)
    if not bin_path.is_file():
        raise ConfigError(f"token file {bin_path} not found", hint="create it with `gptoss prepare-data`")
    itemsize = TOKEN_ITEMSIZE[header["dtype"]]
    size = bin_path.stat().st_size
    num_tokens = size // itemsize
    if size % itemsize or num_tokens != header.get("num_tokens", num_tokens):
        raise ConfigError(
            f"{bin_path}: {size} bytes do not hold the {header.get('num_tokens')} {header['dtype']} tokens "
            f"that {json_path.name} announces",
            hint="re-create the files with `gptoss prepare-data`",
        )
    if vocab_size is not None:
        check_header_fits_model(header, json_path, vocab_size)
    if has_documents(header):
        check_document_files(path, header, num_tokens)
    return bin_path, json_path, header, num_tokens


__all__ = ["TOKEN_FORMAT", "TOKEN_FORMAT_VERSION", "DOCUMENTS_FORMAT_VERSION", "TOKEN_FORMAT_VERSIONS", "TOKEN_ITEMSIZE",
           "INDEX_DTYPE", "MASK_DTYPE", "DOCUMENT_FIELDS", "token_dtype_for", "token_file_paths", "document_file_paths",
           "write_atomically", "write_document_index", "token_header", "write_token_header", "commit_token_set",
           "read_token_header", "has_documents", "read_document_offsets",
           "check_document_files", "check_header_fits_model", "check_token_files"]
