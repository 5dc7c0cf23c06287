"""The GGUF file of `convert --to gguf`, written as the conversion streams: the gguf package (llama.cpp's own
writer) writes the header, the key-values and the tensor table; the tensor data follows in row pieces, each
tensor at the offset that table gives it (GGUF aligns every tensor's start to 32 bytes, the padding zeros).

Nothing of a tensor is held past its piece, and a piece out of order, a tensor short of its bytes or one too
many is refused: the table's offsets would no longer match the data.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from gptoss_cli.checkpoint.formats.gguf import encode as enc
from gptoss_cli.checkpoint.formats.gguf.metadata import (
    ARCH_KEY, FILE_TYPE_MXFP4_MOE, FILE_TYPES, PROVENANCE_KEY, architecture_keys, tokenizer_keys, window_keys,
)
from gptoss_cli.checkpoint.formats.gguf.names import ARCH
from gptoss_cli.errors import UsageError

EXTRA = "gguf"  # the optional dependency: pip install 'gptoss-cli[gguf]'


def import_gguf():
    """The gguf package, or one line naming the extra that installs it."""
    try:
        import gguf  # noqa: PLC0415
    except ImportError:
        raise UsageError("writing GGUF needs the gguf package (llama.cpp's GGUF writer), which is not installed",
                         hint=f"pip install 'gptoss-cli[{EXTRA}]'") from None
    return gguf


class GgufWriter:
    """One GGUF file: `add_metadata`, `start` (header, keys, tensor table), `write` pieces in order, `close`."""

    def __init__(self, path: Path, specs: list, *, on_bytes: Callable[[int], None] | None = None):
        gguf = import_gguf()
        self.path = Path(path)
        self.specs = specs
        self.on_bytes = on_bytes
        self._gw = gguf.GGUFWriter(None, ARCH)
        self._fh = None
        self._pos = 0
        self._done = 0  # bytes of the current tensor written
        self.bytes_written = 0
        self.io_seconds = 0.0
        self.file_names = [self.path.name]

    def add_metadata(self, plan: Any, provenance: dict) -> list[str]:
        """The architecture, tokenizer and provenance keys and the tensor table; returns notes for the user."""
        gguf = import_gguf()
        source, gw = plan.source, self._gw
        gw.add_name(Path(str(source.origin)).name or "gpt-oss")
        architecture_keys(gw, source.arch)
        if plan.expert_type == enc.MXFP4 and plan.ggml_type != enc.Q8_0:
            gw.add_file_type(FILE_TYPE_MXFP4_MOE)
        else:
            gw.add_file_type(FILE_TYPES[plan.ggml_type.lower()])
        window_keys(gw, source.arch)
        gw.add_quantization_version(gguf.GGML_QUANT_VERSION)
        notes = tokenizer_keys(gw, Path(source.extras_folder), source.arch)
        gw.add_string(PROVENANCE_KEY, json.dumps(provenance, sort_keys=True, default=str))
        gw.add_string(ARCH_KEY, json.dumps(source.arch.to_dict(), sort_keys=True))
        for spec in self.specs:
            gw.add_tensor_info(spec.name, spec.shape, _dummy_dtype(), spec.nbytes,
                               raw_dtype=gguf.GGMLQuantizationType[spec.ggml_type])
        total, shared, expert, count = gw.get_total_parameter_count()
        gw.add_size_label(gguf.size_label(total, shared, expert, count))  # as llama.cpp's converter labels it
        return notes

    def start(self) -> None:
        t0 = time.perf_counter()
        self._gw.write_header_to_file(self.path)
        self._gw.write_kv_data_to_file()
        self._gw.write_ti_data_to_file()
        self._fh = self._gw.fout[0]
        self._pad()
        self.io_seconds += time.perf_counter() - t0

    def _pad(self) -> None:
        align = self._gw.data_alignment
        pad = -self._fh.tell() % align
        if pad:
            self._fh.write(bytes(pad))

    def write(self, name: str, chunk: torch.Tensor) -> None:
        """Append `chunk` (the next bytes of tensor `name`, uint8, in table order) to the file."""
        spec = self.specs[self._pos] if self._pos < len(self.specs) else None
        if spec is None or spec.name != name:
            raise RuntimeError(f"GGUF writer expected {spec.name if spec else 'nothing'}, got {name}")
        data = chunk.detach().contiguous().view(torch.uint8).reshape(-1)
        if self._done + data.numel() > spec.nbytes:
            raise RuntimeError(f"{name}: {self._done + data.numel()} bytes, more than the {spec.nbytes} planned")
        t0 = time.perf_counter()
        self._fh.write(memoryview(data.numpy()))
        self.io_seconds += time.perf_counter() - t0
        self._done += data.numel()
        self.bytes_written += data.numel()
        if self.on_bytes:
            self.on_bytes(data.numel())
        if self._done == spec.nbytes:
            self._pad()
            self._pos += 1
            self._done = 0

    def close(self) -> None:
        if self._pos != len(self.specs):
            raise RuntimeError(f"GGUF writer closed before tensor {self.specs[self._pos].name} was written")
        t0 = time.perf_counter()
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        self.io_seconds += time.perf_counter() - t0

    def abort(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None


def _dummy_dtype():
    import numpy as np  # noqa: PLC0415

    return np.float32  # with raw_dtype given, the gguf package takes the shape as values (not bytes)


__all__ = ["GgufWriter", "import_gguf", "EXTRA"]
