"""Content digests that tie a score file to its data, its model and its tokenizer (sha256, streamed).

- `data_digest(PREFIX)`: the token file's content: the tokens (.bin), the document index (.idx) and
  loss mask (.mask) of a version-2 file, and the header fields that change what they mean (version,
  dtype, num_tokens, num_documents, loss_mask). Not the rest of the header (source paths, the
  tokenizer's path): the same tokens prepared from another folder score the same.
- `checkpoint_digest(CHECKPOINT)`: the files the checkpoint's tensors are read from (every file its
  reader names for a tensor: safetensors shards, DCP .distcp files, a LoRA run's base and adapters)
  plus its architecture file, by name and content. Files rather than the tensors as loaded: the
  digest is then the same whatever dtype the model is loaded in, whatever EP layout splits the
  experts and whichever ranks read what, and anyone holding the checkpoint can compute it without
  building the model (the trainer of a DPO run checks its reference this way). A training
  checkpoint's .distcp files also hold the optimizer's state, so two checkpoints with equal weights
  but different optimizer states differ: a stricter answer, never a wrong match.
- `tokenizer_digest(CHECKPOINT)`: the checkpoint's tokenizer.json, or None when it has none.

Every digest reads "sha256:<hex>". Files are hashed in parallel threads (hashlib releases the GIL),
in blocks of 8 MiB: memory stays flat whatever the size.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

from gptoss_cli.data.token_format import document_file_paths, has_documents, read_token_header, token_file_paths
from gptoss_cli.errors import file_system_error

BLOCK = 8 << 20
# the header fields that change what a token file's bytes mean
DATA_HEADER_FIELDS = ("version", "dtype", "num_tokens", "num_documents", "loss_mask")


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of one file's content, read in blocks."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            while block := fh.read(BLOCK):
                h.update(block)
    except OSError as exc:
        raise file_system_error(exc, "cannot read a file to digest it") from None
    return h.hexdigest()


def files_digest(entries: Iterable[tuple[str, Path]], extra: dict | None = None) -> str:
    """One digest of named files: sha256 over `name size sha256` lines in name order (and `extra`, a
    JSON object, first); the files are hashed in parallel."""
    entries = sorted(set(entries))
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(entries)))) as pool:
        hashes = list(pool.map(lambda e: file_sha256(e[1]), entries))
    h = hashlib.sha256()
    if extra is not None:
        h.update((json.dumps(extra, sort_keys=True) + "\n").encode())
    for (name, path), digest in zip(entries, hashes):
        h.update(f"{name} {path.stat().st_size} {digest}\n".encode())
    return "sha256:" + h.hexdigest()


def data_digest(prefix: str | Path) -> str:
    """The digest of a token file (module docstring): its tokens, index and mask, and the header's meaning."""
    header = read_token_header(prefix)
    bin_path, _ = token_file_paths(prefix)
    entries = [("tokens", bin_path)]
    if has_documents(header):
        idx_path, mask_path = document_file_paths(prefix)
        entries.append(("index", idx_path))
        if header.get("loss_mask"):
            entries.append(("mask", mask_path))
    return files_digest(entries, {k: header.get(k) for k in DATA_HEADER_FIELDS})


def checkpoint_files(checkpoint: str | Path) -> list[tuple[str, Path]]:
    """(name, path) of the files a checkpoint's tensors are read from, and its architecture file."""
    from gptoss_cli.checkpoint.sources import open_source  # noqa: PLC0415

    source = open_source(str(checkpoint))
    try:
        reader = source.reader
        paths = {Path(reader.file_of(n)) for n in reader.names()}
        arch = Path(source.folder) / source.format.arch_file
        if arch.is_file():
            paths.add(arch)
    finally:
        source.close()
    root = Path(source.folder)
    # named relative to the checkpoint (not resolved: a Hub cache's files are links to blobs), so a copy
    # elsewhere has the same digest; a file outside it (a LoRA run's base) by its own name
    return [(str(p.relative_to(root)) if p.is_relative_to(root) else f"outside/{p.name}", p) for p in paths]


def checkpoint_digest(checkpoint: str | Path) -> str:
    """The digest of a checkpoint's weights, as the files holding them (module docstring)."""
    return files_digest(checkpoint_files(checkpoint))


def tokenizer_digest(checkpoint: str | Path) -> str | None:
    """The digest of the checkpoint's tokenizer.json (where tokenizer files are looked up), or None."""
    from gptoss_cli.checkpoint.sources import open_source  # noqa: PLC0415

    source = open_source(str(checkpoint))
    try:
        path = Path(source.extras_folder) / "tokenizer.json"
    finally:
        source.close()
    return "sha256:" + file_sha256(path) if path.is_file() else None


__all__ = ["data_digest", "checkpoint_digest", "checkpoint_files", "tokenizer_digest", "files_digest", "file_sha256"]
