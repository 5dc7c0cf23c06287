"""The rows of conversation datasets, streamed: JSONL files, Parquet files, Hugging Face dataset folders
(`save_to_disk`, Arrow files), and dataset ids found in the Hugging Face Hub cache.

A row is a JSON object (a JSONL line) or a table row as a dict. Rows come in batches of at most
`batch_rows`, so memory is bounded by a batch (and, for Parquet, the row group pyarrow decodes), not by
the file. Parquet and Arrow rows drop their null fields (a column a row does not use is null there).
A row that cannot be read (invalid UTF-8, not JSON) comes as an error naming its file and row, for the
caller to raise or count. Reading Parquet and Arrow needs pyarrow (the `datasets` extra). Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from gptoss_cli.errors import UsageError
from gptoss_cli.json_input import parse_json
from gptoss_cli.data.prepare.text import decode_line

JSONL = (".jsonl", ".json")
TABLES = (".parquet", ".arrow")
DATA_FILES = JSONL + TABLES
BATCH_ROWS = 256


@dataclass
class Row:
    where: str  # "FILE:LINE" (JSONL, lines from 1) or "FILE row N" (tables, rows from 0)
    nbytes: int  # the input bytes it stands for (progress)
    value: Any = None
    error: str | None = None  # why it could not be read


@dataclass(frozen=True)
class InputFile:
    path: Path
    kind: str  # "jsonl", "parquet" or "arrow"


def _pyarrow() -> Any:
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise UsageError("reading Parquet and Arrow files needs pyarrow",
                         hint="pip install 'gptoss-cli[datasets]'") from None
    return pyarrow


def _kind(path: Path) -> str:
    return {".parquet": "parquet", ".arrow": "arrow"}.get(path.suffix, "jsonl")


def _split_files(folder: Path, split: str | None) -> list[Path]:
    """The data files of a dataset folder for a split: a `save_to_disk` folder (dataset_dict.json / state.json)
    or a folder of files named by split (train-00000-of-00001.parquet, data/train/..., test.jsonl)."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        chosen = split or (splits[0] if len(splits) == 1 else "train" if "train" in splits else None)
        if chosen not in splits:
            raise UsageError(f"{folder}: {'no split ' + repr(split) if split else 'several splits'}; "
                             f"pass --split with one of {', '.join(splits)}")
        return _split_files(folder / chosen, None)
    if (folder / "state.json").is_file():
        state = json.loads((folder / "state.json").read_text())
        if split is not None and state.get("_split") not in (None, split):
            raise UsageError(f"{folder} holds split {state.get('_split')!r}, not --split {split!r}")
        return [folder / f["filename"] for f in state.get("_data_files", [])]
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in DATA_FILES
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    by_split: dict[str, list[Path]] = {}
    for p in files:
        rel = p.relative_to(folder)
        names = [rel.stem.split("-")[0].split(".")[0]] + [d for d in rel.parts[:-1]]
        for name in ("train", "validation", "test", split):
            if name is not None and name in names:
                by_split.setdefault(name, []).append(p)
                break
    if not by_split:
        if split not in (None, "train"):
            raise UsageError(f"{folder}: its files are not named by split; no --split {split!r}")
        return files
    chosen = split or ("train" if "train" in by_split else None)
    if chosen not in by_split:
        raise UsageError(f"{folder}: {'no split ' + repr(split) if split else 'several splits'}; "
                         f"pass --split with one of {', '.join(sorted(by_split))}")
    return by_split[chosen]


def _hub_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
    except Exception:  # not cached (or not a repo id): the caller says so
        return None


def resolve_inputs(inputs: list[str | Path], split: str | None = None) -> list[InputFile]:
    """The data files behind the inputs: files as given, dataset folders by split, dataset ids through the
    Hugging Face Hub cache (never downloaded here). UsageError naming an input that is none of these."""
    if not inputs:
        raise UsageError("no input files given")
    out = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            if split is not None:
                raise UsageError(f"--split applies to dataset folders and ids, not the file {path}")
            out.append(InputFile(path, _kind(path)))
            continue
        folder = path if path.is_dir() else None
        if folder is None and "/" in str(item).strip("/") and not str(item).startswith((".", "/")):
            folder = _hub_snapshot(str(item))
        if folder is None:
            raise UsageError(f"input {item} not found (a file, a dataset folder, or a dataset id in the Hugging Face "
                             "cache)", hint=f"huggingface-cli download {item} --repo-type dataset")
        files = _split_files(folder, split)
        if not files:
            raise UsageError(f"{item}: no data files (.jsonl, .parquet, .arrow) in {folder}")
        out += [InputFile(p, _kind(p)) for p in files]
    return out


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _jsonl_rows(path: Path, errors: str) -> Iterator[Row]:
    decode = "replace" if errors == "replace" else "strict"
    offset = 0
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, 1):
            where = f"{path}:{number}"
            try:
                text = decode_line(raw, path, offset, decode)
            except UsageError as exc:
                if errors != "skip":
                    raise
                yield Row(where, len(raw), error=str(exc).split(": ", 1)[-1])
                offset += len(raw)
                continue
            offset += len(raw)
            if not text.strip():
                yield Row(where, len(raw), value=None)
                continue
            try:
                yield Row(where, len(raw), value=parse_json(text))
            except (json.JSONDecodeError, ValueError) as exc:
                reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
                yield Row(where, len(raw), error=f"not JSON ({reason})")


def _table_batches(f: InputFile, batch_rows: int) -> Iterator[Any]:
    pa = _pyarrow()
    if f.kind == "parquet":
        yield from pa.parquet.ParquetFile(str(f.path)).iter_batches(batch_size=batch_rows)
        return
    source = pa.memory_map(str(f.path))
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
        return
    yield from reader


def _table_rows(f: InputFile, batch_rows: int) -> Iterator[Row]:
    pa = _pyarrow()
    try:
        size = f.path.stat().st_size
        total = (pa.parquet.ParquetFile(str(f.path)).metadata.num_rows if f.kind == "parquet" else None)
        index = 0
        for batch in _table_batches(f, batch_rows):
            for start in range(0, batch.num_rows, batch_rows):
                part = batch.slice(start, batch_rows)
                share = size * part.num_rows // total if total else part.nbytes
                for k, row in enumerate(part.to_pylist()):
                    yield Row(f"{f.path} row {index}", share // max(part.num_rows, 1), value=_drop_nulls(row))
                    index += 1
    except (pa.ArrowException, OSError, ValueError) as exc:  # ValueError: bytes that are not UTF-8 where text is due
        raise UsageError(f"{f.path}: not a readable {f.kind} file ({(str(exc) or type(exc).__name__).splitlines()[0]})") \
            from None


def iter_rows(files: list[InputFile], errors: str = "strict", batch_rows: int = BATCH_ROWS) -> Iterator[list[Row]]:
    """The rows of every file, in order, in batches of at most `batch_rows` (blank JSONL lines come as rows with
    value None). errors: "strict"/"replace" (invalid UTF-8 in JSONL: an error naming the file and byte offset, or
    U+FFFD), "skip" (such a line comes as a Row with its error)."""
    batch: list[Row] = []
    for f in files:
        rows = _jsonl_rows(f.path, errors) if f.kind == "jsonl" else _table_rows(f, batch_rows)
        for row in rows:
            batch.append(row)
            if len(batch) >= batch_rows:
                yield batch
                batch = []
    if batch:
        yield batch


__all__ = ["Row", "InputFile", "resolve_inputs", "iter_rows", "BATCH_ROWS", "DATA_FILES"]
