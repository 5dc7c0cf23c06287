"""Safetensors reading and writing that streams: row ranges in, tensors out in pieces.

We parse and write the safetensors container ourselves (it is an 8-byte header length, a JSON
header and raw little-endian bytes) because the library's writer needs every tensor of a file in
memory at once and its reader maps whole files; conversion of a 120B model must hold one tensor
group, not one shard. Files written here are read back by `safetensors.safe_open` in the tests.
Large shards are written with O_DIRECT, past the page cache (see `direct_write.py`).
Nothing here unpickles anything.
"""

from __future__ import annotations

import errno
import json
import math
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from gptoss_cli.allocation import claimed
from gptoss_cli.checkpoint.storage import direct_write
from gptoss_cli.errors import CheckpointError
from gptoss_cli.json_input import parse_json

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors' header codes (its own vocabulary; model/dtypes.py names the dtypes recipes and configs use)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_CODES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class SafetensorsFile:
    """One .safetensors file: a validated header, and reads of whole tensors or dim-0 row ranges."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._fh = open(self.path, "rb")
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: shard file is missing") from None
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open ({exc.strerror})") from None
        self.file_size = os.fstat(self._fh.fileno()).st_size
        self._lock = threading.Lock()
        self.specs: dict[str, TensorSpec] = {}
        self._offsets: dict[str, int] = {}
        self.metadata: dict[str, str] = {}
        self._parse_header()

    def _fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: corrupt safetensors header ({what})")

    def _parse_header(self) -> None:
        raw = self._fh.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{self.path}: truncated safetensors file ({self.file_size} bytes, no header)")
        n = int.from_bytes(raw, "little")
        if n > MAX_HEADER_BYTES or n + 8 > self.file_size:
            raise self._fail(f"header length {n} does not fit in a {self.file_size}-byte file")
        try:
            header = parse_json(self._fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._fail(f"header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        data_start = 8 + n
        data_size = self.file_size - data_start
        for name, entry in header.items():
            if name == "__metadata__":
                self.metadata = entry if isinstance(entry, dict) else {}
                continue
            if not isinstance(entry, dict):
                raise self._fail(f"entry {name!r} is not an object")
            dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
            shape = entry.get("shape")
            offsets = entry.get("data_offsets")
            if dtype is None:
                raise self._fail(f"tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise self._fail(f"tensor {name!r} has invalid shape {shape!r}")
            if (
                not isinstance(offsets, list)
                or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]
            ):
                raise self._fail(f"tensor {name!r} has invalid data_offsets {offsets!r}")
            spec = TensorSpec(name, tuple(shape), dtype)
            if offsets[1] - offsets[0] != spec.nbytes:
                raise self._fail(
                    f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes but shape {shape} "
                    f"of {entry['dtype']} needs {spec.nbytes}"
                )
            if offsets[1] > data_size:
                raise CheckpointError(
                    f"{self.path}: truncated shard: tensor {name!r} ends at byte {data_start + offsets[1]} "
                    f"but the file has {self.file_size} bytes",
                    hint="re-download or re-copy this file",
                )
            self.specs[name] = spec
            self._offsets[name] = data_start + offsets[0]

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Read tensor `name`, or rows [start, stop) of its first dimension, into fresh memory."""
        spec = self.specs[name]
        if not spec.shape:
            start, stop = 0, 1
            shape: tuple[int, ...] = ()
        else:
            start = 0 if start is None else start
            stop = spec.shape[0] if stop is None else stop
            if not 0 <= start <= stop <= spec.shape[0]:
                raise IndexError(f"rows [{start}, {stop}) outside {name} {spec.shape}")
            shape = (stop - start, *spec.shape[1:])
        row_bytes = spec.row_bytes if spec.shape else _itemsize(spec.dtype)
        nbytes = (stop - start) * row_bytes
        # a header may claim more than the file holds (a sparse file): refused or named, never a traceback
        buf = claimed(f"{self.path}: tensor {name!r}", nbytes, lambda: torch.empty(nbytes, dtype=torch.uint8), self.path)
        got = self._read_into(memoryview(buf.numpy()), self._offsets[name] + start * row_bytes) if nbytes else 0
        if got != nbytes:
            raise CheckpointError(f"{self.path}: truncated shard while reading tensor {name!r}")
        # safetensors stores little-endian data, which is what every platform torch supports here is.
        return buf.view(spec.dtype).reshape(shape)

    def _read_into(self, view: memoryview, offset: int) -> int:
        """Read at `offset` until `view` is full or the file ends; returns the bytes read.

        Positional reads leave the file position alone, so conversion threads read tensors of one
        file at the same time.
        """
        if not hasattr(os, "preadv"):  # no positional reads on this platform: one reader at a time
            with self._lock:
                self._fh.seek(offset)
                return self._fh.readinto(view) or 0
        fd, got = self._fh.fileno(), 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)  # one call returns at most ~2 GiB
            if n == 0:
                break
            got += n
        return got

    def close(self) -> None:
        self._fh.close()


class CheckpointReader:
    """All safetensors of a checkpoint folder, by tensor name (index file or a plain set of shards)."""

    def __init__(self, folder: str | Path, *, files: Sequence[str] | None = None):
        self.folder = Path(folder)
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        index = self.folder / INDEX_NAME
        if files is not None:
            names = list(files)
        elif index.exists():
            names = self._read_index(index)
        else:
            names = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not names:
                raise CheckpointError(f"{self.folder}: no .safetensors files and no {INDEX_NAME}")
        try:
            for fname in names:
                self._files[fname] = f = SafetensorsFile(self.folder / fname)
                for tname in f.specs:
                    if tname in self._where:
                        raise CheckpointError(
                            f"{self.folder}: tensor {tname!r} appears in both {self._where[tname]} and {fname}"
                        )
                    self._where[tname] = fname
        except BaseException:
            self.close()
            raise
        if index.exists() and files is None:
            self._check_index_agrees()

    def _read_index(self, index: Path) -> list[str]:
        try:
            data = parse_json(index.read_text())
            weight_map = data["weight_map"]
            assert isinstance(weight_map, dict)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index (not JSON: {exc})") from None
        except (KeyError, AssertionError, TypeError):
            raise CheckpointError(f"{index}: not a valid safetensors index (needs a 'weight_map' object)") from None
        root = self.folder.resolve()
        names = []
        for tname, fname in weight_map.items():
            if not isinstance(fname, str):
                raise CheckpointError(f"{index}: tensor {tname!r} maps to non-string {fname!r}")
            target = (self.folder / fname).resolve()
            if os.path.isabs(fname) or ".." in Path(fname).parts or root not in target.parents:
                raise CheckpointError(
                    f"{index}: tensor {tname!r} points to {fname!r}, outside the checkpoint folder",
                    hint="an index may only name files inside its own folder",
                )
            if fname not in names:
                names.append(fname)
        self._index_map = weight_map
        return names

    def _check_index_agrees(self) -> None:
        for tname, fname in self._index_map.items():
            if self._where.get(tname) != fname:
                raise CheckpointError(
                    f"{self.folder / INDEX_NAME}: tensor {tname!r} is listed in {fname} but that file does not hold it"
                )

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def spec(self, name: str) -> TensorSpec:
        if name not in self._where:  # one line naming it, never a KeyError
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing")
        return self._files[self._where[name]].specs[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.spec(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self.spec(name).dtype

    def file_of(self, name: str) -> Path:
        return self.folder / self._where[name]

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        self.spec(name)  # a missing name is one line
        return self._files[self._where[name]].read(name, start, stop)


def shard_file_name(i: int, n: int, prefix: str = "model") -> str:
    return f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors"


class ShardedWriter:
    """Writes a planned list of tensors into shards, sequentially, accepting each tensor in row chunks.

    The plan (names, shapes, dtypes, order) is fixed up front so that every shard header can be
    written before its data; `write` then takes pieces in plan order and checks them against it.
    `single_file`: every tensor in one file of that name, without an index (a PEFT adapter).
    """

    def __init__(
        self,
        folder: Path,
        plan: Sequence[TensorSpec],
        *,
        max_shard_bytes: int = 5 * 1024**3,
        metadata: dict[str, str] | None = None,
        on_bytes: Callable[[int], None] | None = None,
        background: bool = True,
        direct_io: bool = True,
        single_file: str | None = None,
    ):
        self.folder = Path(folder)
        self.plan = list(plan)
        self._index: dict[str, int] = {}
        for i, spec in enumerate(self.plan):
            if spec.name in self._index:
                raise ValueError(f"tensor {spec.name} planned twice")
            self._index[spec.name] = i
        self.metadata = {"format": "pt", **(metadata or {})}
        self.on_bytes = on_bytes
        self.direct_io = direct_io  # O_DIRECT for shards of DIRECT_MIN_BYTES or more (see direct_write.py)
        self.shards: list[list[TensorSpec]] = []
        current: list[TensorSpec] = []
        size = 0
        for spec in self.plan:
            if current and size + spec.nbytes > max_shard_bytes:
                self.shards.append(current)
                current, size = [], 0
            current.append(spec)
            size += spec.nbytes
        if current or not self.shards:
            self.shards.append(current)
        self.file_names = [shard_file_name(i, len(self.shards)) for i in range(len(self.shards))]
        self.write_index = single_file is None  # one named file (a PEFT adapter) has no index
        if single_file is not None:
            self.shards, self.file_names = [list(self.plan)], [single_file]
        self._shard_of = {s.name: i for i, shard in enumerate(self.shards) for s in shard}
        self._file_offset: dict[str, int] = {}  # where each tensor's bytes start in its shard file
        for shard in self.shards:
            offset = len(self._header_bytes(shard))
            for spec in shard:
                self._file_offset[spec.name] = offset
                offset += spec.nbytes
        self._pos = 0  # index into plan of the tensor being written
        self._rows_done = 0
        self._fh = None
        self._open_shard = -1
        self._planned_shard = -1
        self.bytes_written = 0
        self.io_seconds = 0.0  # time spent in file I/O (on the writer thread when background)
        # File writes run on a thread so that the next chunk is decoded while this one is written
        # (file I/O releases the GIL); the queue holds at most two chunks, which bounds memory.
        self._queue: queue.Queue | None = queue.Queue(maxsize=2) if background else None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if self._queue is not None:
            self._thread = threading.Thread(target=self._drain, name="gptoss-shard-writer", daemon=True)
            self._thread.start()

    # --- writing -------------------------------------------------------------------------
    def empty(self, name: str, row: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A fresh tensor to compute rows [row, row + shape[0]) of planned tensor `name` into, placed
        in memory for the file offset those rows will be written at, so that a shard written with
        O_DIRECT takes it without a copy (`direct_write.aligned_empty`). Safe from any thread."""
        spec = self.plan[self._index[name]]
        return direct_write.aligned_empty(shape, dtype, self._file_offset[name] + row * spec.row_bytes)

    def _header_bytes(self, shard: list[TensorSpec]) -> bytes:
        header: dict[str, object] = {"__metadata__": self.metadata}
        offset = 0
        for spec in shard:
            header[spec.name] = {
                "dtype": SAFETENSORS_CODES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as the library does
        return len(raw).to_bytes(8, "little") + raw

    def _io(self, fn, *args):
        try:
            return fn(*args)
        except OSError as exc:
            path = self.folder / self.file_names[max(self._open_shard, 0)]
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CheckpointError(
                    f"{path}: disk full while writing the checkpoint", hint="free space or choose another DST"
                ) from None
            raise CheckpointError(f"{path}: write failed ({exc.strerror or exc})") from None

    def _switch_to(self, shard: int) -> None:
        if self._fh is not None:
            self._io(self._fh.close)
        self._open_shard = shard
        path = self.folder / self.file_names[shard]
        if self.direct_io and sum(s.nbytes for s in self.shards[shard]) >= direct_write.DIRECT_MIN_BYTES:
            self._fh = self._io(direct_write.DirectFile, path)
        else:
            self._fh = self._io(open, path, "wb")
        self._io(self._fh.write, self._header_bytes(self.shards[shard]))

    # --- I/O, inline or on the writer thread ---------------------------------------------------
    def _do(self, op: str, arg) -> None:
        t0 = time.perf_counter()
        try:
            self._do_io(op, arg)
        finally:
            self.io_seconds += time.perf_counter() - t0

    def _do_io(self, op: str, arg) -> None:
        if op == "switch":
            self._switch_to(arg)
        elif op == "data":
            self._io(self._fh.write, arg if isinstance(self._fh, direct_write.DirectFile) else memoryview(arg.numpy()))
            if self.on_bytes is not None:
                self.on_bytes(arg.numel())
        elif op == "close" and self._fh is not None:
            self._io(self._fh.close)
            self._fh = None

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is None:
                try:
                    self._do(*item)
                except BaseException as exc:  # handed to the producer on its next call
                    self._error = exc

    def _submit(self, op: str, arg=None) -> None:
        if self._error is not None:
            raise self._error
        if self._queue is None:
            self._do(op, arg)
        else:
            self._queue.put((op, arg))

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    @property
    def expected(self) -> TensorSpec | None:
        return self.plan[self._pos] if self._pos < len(self.plan) else None

    def write(self, name: str, chunk: torch.Tensor) -> None:
        """Append `chunk` (the next rows of tensor `name`, in plan order) to the output."""
        spec = self.expected
        if spec is None or spec.name != name:
            raise RuntimeError(f"writer expected {spec.name if spec else 'nothing'}, got {name}")
        if chunk.dtype != spec.dtype:
            raise RuntimeError(f"{name}: chunk dtype {chunk.dtype} != planned {spec.dtype}")
        rows = chunk.shape[0] if spec.shape else 1
        if spec.shape and (tuple(chunk.shape[1:]) != spec.shape[1:] or self._rows_done + rows > spec.shape[0]):
            raise RuntimeError(f"{name}: chunk {tuple(chunk.shape)} does not continue {spec.shape}")
        shard = self._shard_of[name]
        if shard != self._planned_shard:
            self._planned_shard = shard
            self._submit("switch", shard)
        data = chunk.detach().contiguous().reshape(-1).view(torch.uint8)
        self._submit("data", data)
        self.bytes_written += data.numel()
        self._rows_done += rows
        if not spec.shape or self._rows_done == spec.shape[0]:
            self._pos += 1
            self._rows_done = 0

    def close(self, index_metadata: dict | None = None) -> None:
        """Finish: every planned tensor must have been written; then write the index."""
        if self.expected is not None:
            raise RuntimeError(f"writer closed before tensor {self.expected.name} was written")
        self._submit("close")
        self._stop_thread()
        if self._error is not None:
            raise self._error
        for i, shard in enumerate(self.shards):  # a shard whose tensors were all empty
            path = self.folder / self.file_names[i]
            if not path.exists():
                self._io(path.write_bytes, self._header_bytes(shard))
        if not self.write_index:
            return
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in self.plan), **(index_metadata or {})},
            "weight_map": {s.name: self.file_names[self._shard_of[s.name]] for s in self.plan},
        }
        self._io((self.folder / INDEX_NAME).write_text, json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        self._stop_thread()
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None

