"""Reading a GGUF file's header: its key-values and tensor table, bounded, for what gptoss asks of a GGUF it is handed
(is it ours to replace, which model does it hold, where is a tensor). Torch-free and gguf-free.

Layout (GGUF version 2 and 3, little-endian): magic `GGUF`, version u32, tensor count u64, key-value count u64;
each key-value: key (u64 length + UTF-8), value type u32, value (strings u64 length + bytes; arrays: item type
u32, count u64, items); each tensor: name, n_dims u32, dims u64 (innermost first), GGML type u32, offset u64 from
the data section, which starts at the next multiple of `general.alignment` (default 32) after the table.

Every length and count is checked against the bytes the file has before anything is allocated, so a hostile
or truncated header is one CheckpointError naming the file and the field, never a large allocation.
Arrays are kept only when short (ARRAY_KEEP items); longer ones (the tokenizer's) as their length.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from gptoss_cli.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
ALIGNMENT = 32
ARRAY_KEEP = 4096
MAX_DIMS = 4
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
# GGML types gptoss knows the size of: id -> (name, values per block, bytes per block)
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 8: ("Q8_0", 32, 34), 30: ("BF16", 1, 2), 39: ("MXFP4", 32, 17)}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first)
    ggml_type: int
    offset: int  # absolute, in the file

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type {self.ggml_type}",))[0]

    @property
    def nbytes(self) -> int | None:
        known = GGML_TYPES.get(self.ggml_type)
        if known is None:
            return None
        _, values, size = known
        rows = 1
        for d in self.shape[:-1]:
            rows *= d
        return rows * (self.shape[-1] // values) * size if self.shape else size


@dataclass
class GgufHeader:
    path: Path
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)  # long arrays as ("array", length)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    data_start: int = 0


class _Cursor:
    def __init__(self, fh: BinaryIO, size: int, path: Path):
        self.fh, self.size, self.path = fh, size, path

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable GGUF file ({what} at byte {self.fh.tell()})",
                               hint="the file is truncated or not GGUF; export it again")

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.fh.tell() + n > self.size:
            raise self.fail(f"{what} runs past the end of the file")
        data = self.fh.read(n)
        if len(data) != n:
            raise self.fail(f"{what} is cut short")
        return data

    def skip(self, n: int, what: str) -> None:
        if n < 0 or self.fh.tell() + n > self.size:
            raise self.fail(f"{what} runs past the end of the file")
        self.fh.seek(n, 1)

    def scalar(self, kind: int, what: str) -> Any:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, keep: bool = True) -> str | None:
        n = self.scalar(10, what)
        if not keep:
            self.skip(n, what)
            return None
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, kind: int, what: str) -> Any:
        if kind in _SCALARS:
            return self.scalar(kind, what)
        if kind == STRING:
            return self.string(what)
        if kind != ARRAY:
            raise self.fail(f"{what} has value type {kind}, which GGUF does not define")
        item, count = self.scalar(4, what), self.scalar(10, what)
        if item not in _SCALARS and item != STRING:
            raise self.fail(f"{what} is an array of value type {item}")
        width = struct.calcsize(_SCALARS[item]) if item in _SCALARS else 8
        if count * width > self.size - self.fh.tell():
            raise self.fail(f"{what} claims {count} items, more than the file holds")
        keep = count <= ARRAY_KEEP
        if item in _SCALARS:
            if not keep:
                self.skip(count * width, what)
                return ("array", count)
            return list(struct.unpack(f"<{count}{_SCALARS[item][1]}", self.take(count * width, what)))
        items = [self.string(what, keep) for _ in range(count)]
        return items if keep else ("array", count)


def read_header(path: str | Path) -> GgufHeader:
    """The key-values and tensor table of GGUF file `path` (module docstring); CheckpointError when it is not one."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            return _read(_Cursor(fh, size, path), path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _read(cur: _Cursor, path: Path) -> GgufHeader:
    if cur.fh.read(4) != MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (no GGUF magic)")
    version = cur.scalar(4, "the version")
    if version not in VERSIONS:
        raise cur.fail(f"version {version} (gptoss reads {' and '.join(map(str, VERSIONS))})")
    n_tensors, n_kv = cur.scalar(10, "the tensor count"), cur.scalar(10, "the key-value count")
    if n_tensors > cur.size // 24 or n_kv > cur.size // 12:  # the smallest entry of each
        raise cur.fail(f"{n_tensors} tensors and {n_kv} key-values claimed in {cur.size} bytes")
    header = GgufHeader(path, version)
    for i in range(n_kv):
        key = cur.string(f"key {i}")
        header.metadata[key] = cur.value(cur.scalar(4, f"the type of {key!r}"), f"value {key!r}")
    infos = []
    for i in range(n_tensors):
        name = cur.string(f"tensor name {i}")
        dims = cur.scalar(4, f"the dimensions of {name!r}")
        if not 1 <= dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {dims} dimensions")
        shape = tuple(cur.scalar(10, f"a dimension of {name!r}") for _ in range(dims))[::-1]
        infos.append((name, shape, cur.scalar(4, f"the type of {name!r}"), cur.scalar(10, f"the offset of {name!r}")))
    align = header.metadata.get("general.alignment", ALIGNMENT)
    if not isinstance(align, int) or not 1 <= align <= 1 << 20:
        raise cur.fail(f"general.alignment {align!r}")
    header.data_start = -(-cur.fh.tell() // align) * align
    for name, shape, kind, offset in infos:
        info = TensorInfo(name, shape, kind, header.data_start + offset)
        if name in header.tensors:
            raise cur.fail(f"tensor {name!r} listed twice")
        nbytes = info.nbytes
        if nbytes is not None and info.offset + nbytes > cur.size:
            raise cur.fail(f"tensor {name!r} ({info.type_name} {list(shape)}) runs past the end of the file")
        header.tensors[name] = info
    return header


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic (file checks only)."""
    try:
        with open(path, "rb") as fh:
            return path.is_file() and fh.read(4) == MAGIC
    except OSError:
        return False


__all__ = ["read_header", "is_gguf", "GgufHeader", "TensorInfo", "GGML_TYPES", "MAGIC"]
