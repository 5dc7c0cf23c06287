"""`MegatronReader`: a Megatron torch_dist checkpoint's model weights under Hybrid names, chunk by chunk."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from gptoss_cli.checkpoint.formats.megatron.names import COMMON, expert_slot, singleton_keys
from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID, hybrid_shapes
from gptoss_cli.checkpoint.storage.dcp_io import METADATA, SpecReader, check_storage_files, read_metadata
from gptoss_cli.checkpoint.storage.safetensors_io import TensorSpec
from gptoss_cli.errors import CheckpointError, first_line
from gptoss_cli.model.config import GptOssArch


class MegatronReader(SpecReader):
    """A Megatron torch_dist checkpoint's model weights under Hybrid names, read chunk by chunk.

    Works for any DP/EP layout at TP=PP=1 and both expert layouts: a Hybrid tensor (or rows of it)
    is assembled from whichever stored chunks overlap it, each read from its byte range with
    torch.load(weights_only=True). The vocabulary padding is hidden (the embedding and output
    present `vocab_size` rows). Optimizer, RNG and `_extra_state` entries are never read.
    """

    concurrent_reads = False  # the last chunk read is cached for the next rows

    def __init__(self, folder: Path, arch: GptOssArch):
        self.folder = Path(folder)
        self.arch = arch
        self.metadata = read_metadata(self.folder)
        check_storage_files(self.folder, self.metadata)
        md = self.metadata.state_dict_metadata
        self._storage = {(i.fqn, tuple(i.offset or ())): info for i, info in (self.metadata.storage_data or {}).items()}
        # name -> its sources: (key, leading offsets in the key (the expert), the rows of the name it holds)
        self._sources: dict[str, list[tuple[str, tuple[int, ...], int, int]]] = {}
        self._specs: dict[str, TensorSpec] = {}
        self.layout = None
        for name, shape in hybrid_shapes(arch).items():
            slot = expert_slot(name, arch)
            if slot is not None and slot.key in md:
                self.layout = self.layout or "stacked"
                self._sources[name] = [(slot.key, (slot.expert,), 0, shape[0])]
            elif slot is not None and all(k in md for k in singleton_keys(name)):
                self.layout = self.layout or "singleton"
                keys = singleton_keys(name)
                rows = shape[0] // len(keys)  # fc1: the gate half (_w), then the up half (_v)
                self._sources[name] = [(k, (), i * rows, rows) for i, k in enumerate(keys)]
            elif name in md:
                self._sources[name] = [(name, (), 0, shape[0])]
            else:
                continue
            for key, lead, _, rows in self._sources[name]:
                self._check_entry(md, name, key, (*([arch.num_local_experts] if lead else []), rows, *shape[1:]))
            self._specs[name] = TensorSpec(name, tuple(shape), md[self._sources[name][0][0]].properties.dtype)
        self._cache: tuple[Any, torch.Tensor] | None = None

    def _check_entry(self, md: dict, name: str, key: str, want: tuple[int, ...]) -> None:
        """`key` is a tensor of the global shape the architecture gives it (vocabulary rows may be padded)."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        if not isinstance(md[key], TensorStorageMetadata):
            raise CheckpointError(f"{self.folder / METADATA}: {key!r} is not a tensor entry")
        stored = tuple(md[key].size)
        ok = stored == want or (name in VOCAB_PADDED_HYBRID and stored[1:] == want[1:] and stored[0] >= want[0])
        if not ok:
            raise CheckpointError(f"{self.folder / METADATA}: {key!r} has global shape {list(stored)}, "
                                  f"expected {list(want)} for the architecture in {COMMON}")

    def close(self) -> None:
        self._cache = None

    def file_of(self, name: str) -> Path:
        key = self._sources[name][0][0] if name in self._sources else name
        for (fqn, _), info in self._storage.items():
            if fqn == key:
                return self.folder / info.relative_path
        return self.folder / METADATA

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Tensor `name`, or rows [start, stop) of it."""
        if name not in self._specs:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing")
        shape = self._specs[name].shape
        r0, r1 = start or 0, shape[0] if stop is None else stop
        out = torch.empty((r1 - r0, *shape[1:]), dtype=self._specs[name].dtype)
        for key, lead, row0, rows in self._sources[name]:
            lo, hi = max(r0, row0), min(r1, row0 + rows)
            if lo < hi:
                region = (*((x, 1) for x in lead), (lo - row0, hi - lo), *((0, n) for n in shape[1:]))
                out[lo - r0:hi - r0] = self._assemble(key, region).reshape(hi - lo, *shape[1:])
        return out

    def _assemble(self, key: str, region: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """The `region` (per-axis start, size) of stored key `key`, from the chunks overlapping it."""
        meta = self.metadata.state_dict_metadata[key]
        out = torch.empty(tuple(s for _, s in region), dtype=meta.properties.dtype)
        covered = 0
        for chunk in meta.chunks:
            lo = [max(r0, c0) for (r0, _), c0 in zip(region, chunk.offsets)]
            hi = [min(r0 + rs, c0 + cs) for (r0, rs), c0, cs in zip(region, chunk.offsets, chunk.sizes)]
            if any(a >= b for a, b in zip(lo, hi)) and region:
                continue
            data = self._chunk(key, tuple(chunk.offsets), tuple(chunk.sizes))
            src = tuple(slice(a - c0, b - c0) for a, b, c0 in zip(lo, hi, chunk.offsets))
            dst = tuple(slice(a - r0, b - r0) for a, b, (r0, _) in zip(lo, hi, region))
            out[dst] = data[src]
            n = 1
            for a, b in zip(lo, hi):
                n *= b - a
            covered += n
        if covered != out.numel():
            raise CheckpointError(f"{self.folder / METADATA}: the chunks of {key!r} do not cover "
                                  f"{[(s, s + n) for s, n in region]} (a shard is missing from the metadata)")
        return out

    def _chunk(self, key: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        if self._cache is not None and self._cache[0] == (key, offsets):
            return self._cache[1]
        info = self._storage.get((key, offsets))
        if info is None:
            raise CheckpointError(f"{self.folder / METADATA}: records no storage for chunk {list(offsets)} of {key!r}")
        path = self.folder / info.relative_path
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{path}: chunk {list(offsets)} of {key!r} is stored with transforms "
                                  f"{info.transform_descriptors}, which gptoss does not read")
        self._cache = None
        try:
            with open(path, "rb") as f:
                data = torch.load(_Window(f, info.offset, info.length), map_location="cpu", weights_only=True)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
        except Exception as exc:
            raise CheckpointError(f"{path}: chunk {list(offsets)} of {key!r} is not a readable tensor "
                                  f"({first_line(exc)})", hint="the checkpoint is damaged") from None
        if not isinstance(data, torch.Tensor) or tuple(data.shape) != sizes:
            raise CheckpointError(f"{path}: chunk {list(offsets)} of {key!r} holds "
                                  f"{list(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__}, "
                                  f"the metadata says {list(sizes)}")
        self._cache = ((key, offsets), data)
        return data


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file as a seekable file of their own, so that
    torch.load reads one chunk in place instead of from a copy of its bytes."""

    def __init__(self, f, offset: int, length: int):
        self._f, self._offset, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self._length - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._offset + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


__all__ = ["MegatronReader"]
