"""Reading a torch.distributed.checkpoint (DCP) folder tensor by tensor, with CheckpointReader's interface.

`DcpReader` serves `names()`, `spec(name)`, `file_of(name)` and `read(name, start, stop)` like
`safetensors_io.CheckpointReader`, so conversion streams a training checkpoint exactly as it
streams a Hybrid one. Each read is one `dcp.load` of a state dict that holds only the requested
keys; DCP then reads only those keys' byte ranges, so memory holds one tensor (or a few experts of
one stack, fetched together to save per-call overhead), never the state dict. Which DP/EP layout
saved the checkpoint does not matter: DCP assembles every key from whatever chunks hold it.

DCP's `.metadata` is a pickle. It is unpickled here with an allow-list of DCP's own metadata
classes (and torch sizes, dtypes, layouts), never with plain `pickle.load`, so a checkpoint from
elsewhere cannot run code; the tensors themselves are read by DCP with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from gptoss_cli import torch_private
from gptoss_cli.allocation import claimed
from gptoss_cli.checkpoint.storage.safetensors_io import TensorSpec
from gptoss_cli.errors import CheckpointError, describe_os_error, first_line
from gptoss_cli.model.expert_names import expert_name, parse_expert_name

METADATA = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                                 "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # megatron-core (0.16) also records every rank's save plan in the Metadata (`all_local_plans`)
    *(("torch.distributed.checkpoint.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib._local", "PosixPath"),
    ("pathlib._local", "PurePosixPath"),
} | {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}

# Megatron-core's writer (0.15) pickled its Metadata subclass and save plan under these names; they load
# as our own inert stand-ins (plain data, no Megatron code), never by importing megatron.
_MCORE = "megatron.core.dist_checkpointing.strategies.torch"
_MEGATRON_STAND_INS = ("MCoreMetadata", "MCoreSavePlan")


def _megatron_stand_in(name: str) -> type:
    from torch.distributed.checkpoint.metadata import Metadata

    return type(name, (Metadata,) if name == "MCoreMetadata" else (), {"__module__": __name__})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == _MCORE and name in _MEGATRON_STAND_INS:
            return _megatron_stand_in(name)
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} (not DCP metadata)")
        return super().find_class(module, name)


def read_metadata(folder: str | Path) -> Any:
    """DCP's Metadata of `folder`, unpickled with the allow-list; CheckpointError if missing or damaged."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(folder) / METADATA
    try:
        data = claimed(str(path), path.stat().st_size, path.read_bytes, path)
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: has no {METADATA}; the checkpoint is incomplete",
                              hint="use a checkpoint that `latest` points at (saves are renamed into place when done)"
                              ) from None
    except OSError as exc:
        raise CheckpointError(describe_os_error(exc, "cannot read the checkpoint metadata")) from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # truncated or foreign bytes: UnpicklingError, EOFError, ValueError, ...
        raise CheckpointError(f"{path}: not readable DCP metadata ({first_line(exc)})",
                              hint="the checkpoint is damaged; use an earlier iter_* folder") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path}: not DCP metadata (holds a {type(metadata).__name__})")
    problem = metadata_problem(metadata)
    if problem:
        raise CheckpointError(f"{path}: not readable DCP metadata ({problem})",
                              hint="the checkpoint is damaged; use an earlier iter_* folder")
    return metadata


def _dims(value: Any) -> tuple[int, ...] | None:
    """`value` as a shape (a tuple or list of non-negative ints, at most 64 of them), or None."""
    if not isinstance(value, (tuple, list)) or len(value) > 64:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 for v in value):
        return None
    return tuple(value)


def _tensor_problem(key: str, meta: Any) -> str | None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

    size = _dims(meta.size)
    if size is None:
        return f"tensor {key!r}: size {meta.size!r:.60} is not a shape"
    props = meta.properties
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
        return f"tensor {key!r}: its properties name no dtype"
    numel = 1
    for d in size:
        numel *= d
    if numel * props.dtype.itemsize >= 2**63:
        return f"tensor {key!r}: size {list(size)} does not fit in memory addresses"
    if not isinstance(meta.chunks, list):
        return f"tensor {key!r}: chunks {meta.chunks!r:.60} is not a list"
    for chunk in meta.chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            return f"tensor {key!r}: a chunk is a {type(chunk).__name__}"
        offsets, sizes = _dims(chunk.offsets), _dims(chunk.sizes)
        if offsets is None or sizes is None or len(offsets) != len(size) or len(sizes) != len(size) \
                or any(o + n > d for o, n, d in zip(offsets, sizes, size)):
            return f"tensor {key!r}: chunk at {chunk.offsets!r:.40} of {chunk.sizes!r:.40} does not lie in {list(size)}"
    return None


def _storage_problem(index: Any, info: Any) -> str | None:
    from pathlib import PurePosixPath

    from torch.distributed.checkpoint.metadata import MetadataIndex

    if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
        return f"a storage entry is keyed by {index!r:.60}, not a tensor index"
    if index.offset is not None and _dims(index.offset) is None:
        return f"storage of {index.fqn!r}: offset {index.offset!r:.40} is not a position"
    if index.index is not None and (not isinstance(index.index, int) or isinstance(index.index, bool)):
        return f"storage of {index.fqn!r}: index {index.index!r:.40} is not an integer"
    if not isinstance(info, torch_private.dcp_storage_info()):
        return f"storage of {index.fqn!r} is a {type(info).__name__}"
    rel = info.relative_path
    if not isinstance(rel, str) or not rel or PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
        return f"storage of {index.fqn!r}: file {rel!r:.60} is not a file name inside the checkpoint"
    for field in ("offset", "length"):
        value = getattr(info, field)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
            return f"storage of {index.fqn!r}: {field} {value!r:.40} is not a byte count"
    return None


def metadata_problem(metadata: Any) -> str | None:
    """What is wrong with the types of an unpickled Metadata's entries, or None: the allow-list admits
    only DCP's classes, but their attributes may still hold anything (a string for a size, a path that
    leaves the folder); every reader relies on what is checked here."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    try:  # an allow-listed object unpickled without one of its fields: AttributeError on reading it
        for key, meta in metadata.state_dict_metadata.items():
            if not isinstance(key, str):
                return f"state dict key {key!r:.60} is not a name"
            if isinstance(meta, BytesStorageMetadata):
                continue
            if not isinstance(meta, TensorStorageMetadata):
                return f"entry {key!r} is a {type(meta).__name__}"
            problem = _tensor_problem(key, meta)
            if problem:
                return problem
        storage = metadata.storage_data
        if storage is None:
            return None
        if not isinstance(storage, dict):
            return f"storage_data is a {type(storage).__name__}, not a table"
        for index, info in storage.items():
            problem = _storage_problem(index, info)
            if problem:
                return problem
    except AttributeError as exc:
        return f"an entry lacks a field ({first_line(exc)})"
    return None


def check_storage_files(folder: Path, metadata: Any) -> None:
    """Every shard file holds the byte range the metadata places in it; the first gap is one line."""
    sizes: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        path = folder / info.relative_path
        if info.relative_path not in sizes:
            sizes[info.relative_path] = path.stat().st_size if path.is_file() else -1
        have = sizes[info.relative_path]
        if have < info.offset + info.length:
            state = "is missing" if have < 0 else f"has {have} bytes"
            raise CheckpointError(
                f"{path}: {state}, but tensor {index.fqn} lies at bytes {info.offset}..{info.offset + info.length}; "
                "the checkpoint is truncated or incomplete",
                hint="point `latest` at an earlier complete iter_* folder, or start in a new checkpoint.dir",
            )


def dcp_error(exc: BaseException) -> str:
    """The first rank's own error inside DCP's CheckpointException (whose first line names no file)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        return f"rank {rank}: {dcp_error(inner)}"
    return describe_os_error(exc) if isinstance(exc, OSError) else first_line(exc)


def interruption(exc: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or Terminated (SIGTERM) a rank got inside DCP, which wraps every BaseException
    of a rank into its CheckpointException; None when the failure was something else."""
    from gptoss_cli.errors import Terminated  # noqa: PLC0415

    if isinstance(exc, (KeyboardInterrupt, Terminated)):
        return exc
    for failure in (getattr(exc, "failures", None) or {}).values():
        found = interruption(failure[0] if isinstance(failure, tuple) else failure)
        if found is not None:
            return found
    return None


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes a single process when torch.distributed is not initialised; that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def storage_reader(folder: str | Path, metadata: Any) -> Any:
    """A DCP FileSystemReader of `folder` that hands DCP `metadata` (read with the allow-list by
    `read_metadata`) instead of unpickling `.metadata` again with plain pickle."""
    from torch.distributed.checkpoint import FileSystemReader

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # the allow-listed copy, read once
            return metadata

    return _Reader(str(folder))


class SpecReader:
    """What a reader of named tensors answers from its `_specs` ({name: TensorSpec}) alone; a context manager."""

    _specs: dict[str, TensorSpec]

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        pass

    def names(self) -> list[str]:
        return list(self._specs)

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def spec(self, name: str) -> TensorSpec:
        try:
            return self._specs[name]
        except KeyError:  # a name the metadata lacks: one line, never a KeyError
            raise CheckpointError(f"{getattr(self, 'folder', '?')}: tensor {name!r} is not in the checkpoint's "
                                  "metadata", hint="the checkpoint is incomplete or damaged") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.spec(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self.spec(name).dtype


class DcpReader(SpecReader):
    """One group of a DCP checkpoint's tensors under plain names, read a tensor (or a few experts) at a time.

    `key_of(name)` gives the DCP key of a name and `name_of(key)` the name of a key (None: not in
    this group); e.g. names are Hybrid tensor names and keys `model.<name>`. `budget_bytes` bounds
    what one read fetches ahead: consecutive experts of the same stack are loaded together up to it.

    Reads are not thread-safe: the fetch-ahead cache serves one stream of reads, so `concurrent_reads`
    tells conversion to read it from one thread (readers without the attribute allow several).
    """

    concurrent_reads = False

    def __init__(self, folder: str | Path, key_of: Callable[[str], str], name_of: Callable[[str], str | None], *,
                 budget_bytes: int = 128 * 1024**2):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.folder = Path(folder)
        self.metadata = read_metadata(self.folder)
        check_storage_files(self.folder, self.metadata)
        self._key_of = key_of
        self.budget_bytes = budget_bytes
        self._specs: dict[str, TensorSpec] = {}
        for key, meta in self.metadata.state_dict_metadata.items():
            name = name_of(key)
            if name is not None and isinstance(meta, TensorStorageMetadata):
                self._specs[name] = TensorSpec(name, tuple(meta.size), meta.properties.dtype)
        self._files = {index.fqn: info.relative_path for index, info in (self.metadata.storage_data or {}).items()}
        self._storage = storage_reader(self.folder, self.metadata)
        self._cache: dict[str, torch.Tensor] = {}
        self.loads = 0  # dcp.load calls made (each one a partial load)

    def close(self) -> None:
        self._cache.clear()

    def file_of(self, name: str) -> Path:
        return self.folder / self._files.get(self._key_of(name), METADATA)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Tensor `name`, or rows [start, stop) of it; the tensor read last stays cached for the next rows."""
        if name not in self._specs:
            raise CheckpointError(f"{self.folder}: tensor {self._key_of(name)!r} is missing")
        if name not in self._cache:
            self._cache = self._load(self._batch(name))
        t = self._cache[name]
        if start is None and stop is None or not t.dim():
            return t
        return t[start or 0:t.shape[0] if stop is None else stop]

    def _batch(self, name: str) -> list[str]:
        """`name`, and for an expert tensor the next experts of its stack that fit in the budget."""
        per_expert = parse_expert_name(name)
        if per_expert is None:
            return [name]
        out, total, e = [], 0, per_expert.expert
        while expert_name(per_expert.stack, e) in self._specs:
            spec = self._specs[expert_name(per_expert.stack, e)]
            if out and total + spec.nbytes > self.budget_bytes:
                break
            out.append(spec.name)
            total += spec.nbytes
            e += 1
        return out

    def _load(self, names: list[str]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        self._cache = {}  # drop the previous tensors before the next ones are allocated
        state = {self._key_of(n): claimed(f"{self.file_of(n)}: tensor {self._key_of(n)!r}", self._specs[n].nbytes,
                                          partial(torch.empty, self._specs[n].shape, dtype=self._specs[n].dtype),
                                          self.file_of(n)) for n in names}
        try:
            with quiet_single_process():
                dcp.load(state, storage_reader=self._storage, no_dist=True)
        except (Exception, CheckpointException) as exc:  # a damaged shard: torch.load's error inside DCP's wrapper
            raise CheckpointError(
                f"{self.file_of(names[0])}: cannot read tensor {self._key_of(names[0])!r} ({dcp_error(exc)})",
                hint="the checkpoint is damaged; use an earlier iter_* folder",
            ) from None
        self.loads += 1
        return {n: state[self._key_of(n)] for n in names}


__all__ = ["DcpReader", "SpecReader", "read_metadata", "storage_reader", "check_storage_files", "dcp_error",
           "quiet_single_process", "METADATA"]
