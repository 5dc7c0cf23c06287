"""The token file format: what `gptoss prepare-data` writes and training memory-maps (no torch here).

For a prefix OUT:
  OUT.bin   the tokens of all documents back to back, each document followed by the EOS id,
            as raw little-endian unsigned integers (uint16 when the vocabulary fits, else uint32);
  OUT.json  the header: {"format": "gptoss-tokens", "version": 1, "dtype": "uint16"|"uint32",
            "num_tokens": N, "num_documents": D, "vocab_size": V, "eos_token_id": id,
            "tokenizer": path, "sources": [...]}.
Sample i of a file is the window tokens[i*S : i*S + S + 1] (inputs = first S, labels = last S), so
a file of N tokens holds (N - 1) // S samples.

Shared by prepare-data (writing), the training data loader (reading) and the recipe rule that
checks the files at launch, which must not need torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gptoss_cli import outputs
from gptoss_cli.errors import ConfigError
from gptoss_cli.json_input import parse_json

TOKEN_FORMAT = "gptoss-tokens"
TOKEN_FORMAT_VERSION = 1
# dtype name -> bytes per token; readers also accept the signed widths older tools wrote
TOKEN_ITEMSIZE = {"uint16": 2, "uint32": 4, "int32": 4, "int64": 8}


def token_dtype_for(vocab_size: int) -> str:
    """The narrowest unsigned width that holds every id of a `vocab_size` vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def token_file_paths(path: str | Path) -> tuple[Path, Path]:
    """(tokens .bin, header .json) for a prefix, a .bin path or a .json path."""
    p = Path(path)
    if p.suffix in (".bin", ".json"):
        p = p.with_suffix("")
    return p.with_suffix(".bin"), p.with_suffix(".json")


def write_token_header(json_path: str | Path, *, dtype: str, num_tokens: int, num_documents: int, vocab_size: int,
                       eos_token_id: int | None, tokenizer: str | None, sources: list[str]) -> dict[str, Any]:
    """Write the header of a token file atomically (a temporary name, then a rename); returns it."""
    json_path = Path(json_path)
    header = {
        "format": TOKEN_FORMAT, "version": TOKEN_FORMAT_VERSION, "dtype": dtype, "num_tokens": num_tokens,
        "num_documents": num_documents, "vocab_size": vocab_size, "eos_token_id": eos_token_id,
        "tokenizer": tokenizer, "sources": list(sources),
    }
    outputs.replace_text(json_path, json.dumps(header, indent=2) + "\n")
    return header


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
    if not isinstance(header, dict) or header.get("format") != TOKEN_FORMAT or header.get("dtype") not in TOKEN_ITEMSIZE:
        got = header if not isinstance(header, dict) else {k: header.get(k) for k in ("format", "dtype")}
        raise ConfigError(f"{json_path}: not a gptoss token header ({got})",
                          hint="create the files with `gptoss prepare-data`")
    for field in ("vocab_size", "eos_token_id", "num_tokens"):
        value = header.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"{json_path}: {field}={value!r} is not a token count/id")
    return header


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
    return bin_path, json_path, header, num_tokens


__all__ = ["TOKEN_FORMAT", "TOKEN_FORMAT_VERSION", "TOKEN_ITEMSIZE", "token_dtype_for", "token_file_paths",
           "write_token_header", "read_token_header", "check_header_fits_model", "check_token_files"]
