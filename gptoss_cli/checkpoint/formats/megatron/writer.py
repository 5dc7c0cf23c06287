"""What `convert --to megatron` writes: `MegatronWriter` (the DCP chunks and `.metadata`) and the folder
files (metadata.json, common.pt)."""

from __future__ import annotations

import argparse
import json
import pickle
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from gptoss_cli import outputs, torch_private
from gptoss_cli.checkpoint.formats.megatron.names import (
    BACKEND, CHECKPOINT_VERSION, COMMON, METADATA_JSON, expert_slot, extra_state_keys,
)
from gptoss_cli.checkpoint.mapping import VOCAB_PADDED_HYBRID
from gptoss_cli.checkpoint.storage.dcp_io import METADATA
from gptoss_cli.checkpoint.storage.safetensors_io import TensorSpec
from gptoss_cli.checkpoint.storage.torch_bytes import save_bytes
from gptoss_cli.model.config import GptOssArch


def _empty_extra_state() -> bytes:
    return bytes(save_bytes([None]))  # what Megatron writes for a module without FP8 state: a list of one None


class MegatronWriter:
    """Writes Hybrid-named tensors, in plan order and in row pieces, as a torch_dist checkpoint.

    Same interface as the safetensors ShardedWriter (`write`, `close`, `abort`, `bytes_written`,
    `file_names`, `io_seconds`). Each piece becomes one DCP chunk, appended to `__0_<n>.distcp`
    files of at most `max_shard_bytes`; expert pieces go to their stacked key at offset e (fc1
    split at the gate/up boundary, as Megatron stores it); vocabulary tensors get zero rows up to
    `padded_rows`. `close` writes `.metadata` (the chunk list, never the data) last.
    """

    def __init__(self, folder: Path, plan: Sequence[TensorSpec], arch: GptOssArch, *, padded_rows: int,
                 max_shard_bytes: int, on_bytes: Callable[[int], None] | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.arch = arch
        self.plan = {s.name: s for s in plan}
        self.padded_rows = padded_rows
        self.max_shard_bytes = max_shard_bytes
        self.on_bytes = on_bytes
        self._rows: dict[str, int] = {}
        self._chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._global: dict[str, tuple[int, ...]] = {}
        self._storage: list[tuple[str, tuple[int, ...] | None, str, int, int]] = []  # key, offsets, file, off, len
        self.file_names: list[str] = []
        self._file = None
        self.bytes_written = 0
        self.io_seconds = 0.0

    def _stream(self, nbytes: int):
        if self._file is None or (self._file.tell() and self._file.tell() + nbytes > self.max_shard_bytes):
            if self._file is not None:
                with outputs.naming(self.folder / self.file_names[-1]):
                    self._file.close()
            name = f"__0_{len(self.file_names)}.distcp"
            with outputs.naming(self.folder / name):
                self._file = open(self.folder / name, "wb")
            self.file_names.append(name)
        return self._file

    def _put(self, key: str, offsets: tuple[int, ...] | None, payload: torch.Tensor | bytes) -> None:
        """Append one chunk (a tensor, or an object's bytes) to the current file and record where it went."""
        t0 = time.perf_counter()
        tensor = isinstance(payload, torch.Tensor)
        nbytes = payload.numel() * payload.element_size() if tensor else len(payload)
        if tensor:  # torch.save stores the whole storage: a view is saved as a copy
            payload = save_bytes(payload.contiguous().clone() if payload.storage_offset() or not payload.is_contiguous()
                                 or payload.untyped_storage().nbytes() != nbytes else payload)
        f = self._stream(len(payload))
        start = f.tell()
        with outputs.naming(self.folder / self.file_names[-1]):
            f.write(payload)
        length = f.tell() - start
        self._storage.append((key, offsets, self.file_names[-1], start, length))
        self.bytes_written += length
        self.io_seconds += time.perf_counter() - t0
        if self.on_bytes and tensor:  # the planned tensor bytes, as the progress total
            self.on_bytes(nbytes)

    def _tensor(self, key: str, global_shape: tuple[int, ...], offsets: tuple[int, ...], data: torch.Tensor) -> None:
        self._global.setdefault(key, global_shape)
        self._dtypes.setdefault(key, data.dtype)
        self._chunks.setdefault(key, []).append((offsets, tuple(data.shape)))
        self._put(key, offsets, data)

    def write(self, name: str, chunk: torch.Tensor) -> None:
        spec = self.plan[name]
        row = self._rows.get(name, 0)
        n = chunk.shape[0] if chunk.dim() else 1
        self._rows[name] = row + n
        slot = expert_slot(name, self.arch)
        if slot is None:
            rows = self.padded_rows if name in VOCAB_PADDED_HYBRID else (spec.shape[0] if spec.shape else 0)
            shape = (rows, *spec.shape[1:]) if spec.shape else ()
            self._tensor(name, shape, (row, *(0,) * (len(shape) - 1)) if shape else (), chunk)
            if name in VOCAB_PADDED_HYBRID and self._rows[name] == spec.shape[0]:
                # zero rows up to the padded size, in pieces no larger than the last real one (streaming)
                for r in range(spec.shape[0], rows, max(1, n)):
                    pad = torch.zeros((min(rows, r + max(1, n)) - r, *spec.shape[1:]), dtype=chunk.dtype)
                    self._tensor(name, shape, (r, *(0,) * (len(shape) - 1)), pad)
            return
        shape = (slot.num_experts, *spec.shape)
        cuts = [row, row + n]
        half = spec.shape[0] // 2
        if slot.glu and row < half < row + n:  # the gate and up halves are separate chunks in Megatron
            cuts = [row, half, row + n]
        for a, b in zip(cuts, cuts[1:]):
            piece = chunk[a - row:b - row]
            self._tensor(slot.key, shape, (slot.expert, a, *(0,) * (len(spec.shape) - 1)), piece.unsqueeze(0))

    def close(self, index_metadata: dict | None = None) -> None:
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
            TensorStorageMetadata,
        )

        storage_info = torch_private.dcp_storage_info()
        for name, spec in self.plan.items():
            if self._rows.get(name, 0) != (spec.shape[0] if spec.shape else 1):
                raise RuntimeError(f"tensor {name} got {self._rows.get(name, 0)} rows, planned {spec.shape}")
        extra = _empty_extra_state()
        for key in extra_state_keys(self.arch):
            self._put(key, None, extra)
        if self._file is not None:
            with outputs.naming(self.folder / self.file_names[-1]):
                self._file.close()
            self._file = None
        state: dict[str, Any] = {}
        for key, shape in self._global.items():
            chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in self._chunks[key]]
            state[key] = TensorStorageMetadata(TensorProperties(dtype=self._dtypes[key]), torch.Size(shape), chunks)
        storage = {}
        index: dict[str, int] = {}
        for key, offsets, file, off, length in self._storage:
            if offsets is None:
                state[key] = BytesStorageMetadata()
                storage[MetadataIndex(key)] = storage_info(file, off, length)
            else:
                i = index[key] = index.get(key, -1) + 1
                storage[MetadataIndex(key, torch.Size(offsets), i)] = storage_info(file, off, length)
        metadata = Metadata(state_dict_metadata=state, planner_data={}, storage_data=storage,
                            storage_meta=StorageMeta(checkpoint_id=None, save_id=None, load_id=None))
        _write_bytes(self.folder / METADATA, pickle.dumps(metadata))

    def abort(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # a full disk again while flushing: the folder is removed anyway
                pass
            self._file = None


def write_folder_files(folder: Path, args: argparse.Namespace, iteration: int, provenance: dict) -> None:
    """metadata.json and common.pt of an iteration folder (the DCP files are the writer's)."""
    outputs.write_text(folder / METADATA_JSON, json.dumps(
        {"sharded_backend": BACKEND, "sharded_backend_version": 1, "common_backend": "torch",
         "common_backend_version": 1}) + "\n")
    _write_bytes(folder / COMMON, save_bytes({"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                                              "iteration": iteration, "num_floating_point_operations_so_far": 0,
                                              "gptoss_provenance": provenance}))


def _write_bytes(path: Path, data: bytes | memoryview) -> None:
    with outputs.naming(path):
        path.write_bytes(data)


__all__ = ["MegatronWriter", "write_folder_files"]
