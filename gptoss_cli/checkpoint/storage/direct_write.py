"""Appending to a file with O_DIRECT, past the page cache: data written from where it lies when it is placed for it, else staged.

`ShardedWriter` (safetensors_io.py) writes its large shards through `DirectFile`, and hands
conversion's workers buffers from `aligned_empty` to compute into; the file falls back to ordinary
writes where the filesystem refuses O_DIRECT.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import queue
import threading
from pathlib import Path

import torch

# Shards at least this large are written with O_DIRECT (below): a checkpoint's shards are
# gigabytes, and small files are better served by the page cache.
DIRECT_MIN_BYTES = 64 * 1024**2
ALIGN = 4096  # file offsets, lengths and buffer addresses of direct writes (the usual logical block)
STAGING_BYTES = 16 * 1024**2
# Pieces written from their own memory that the I/O thread may hold at once (each stays alive until
# written): with the two staging buffers, what bounds the writer's memory.
IN_FLIGHT = 2


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, offset: int) -> torch.Tensor:
    """An uninitialised contiguous tensor whose first byte lies at `offset` modulo `ALIGN` in memory.

    Placed so for the file offset its bytes will be written at, a `DirectFile` writes its whole
    blocks from this memory, without copying them (torch's allocator aligns to 64 bytes only: the
    block is over-allocated by ALIGN bytes and sliced). An `offset` that is not a multiple of the
    element size (safetensors does not pad between tensors) gets ordinary memory: it is staged."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if offset % itemsize:
        return torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * itemsize
    base = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    shift = (offset - base.data_ptr()) % ALIGN
    return base[shift : shift + nbytes].view(dtype).view(shape)


def open_direct(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_DIRECT, 0o666)


class DirectFile:
    """A file written with O_DIRECT: tensors placed in memory for it are written as they lie, the
    rest through two page-aligned staging buffers, by an I/O thread.

    Writing through the page cache costs the kernel a copy and the page bookkeeping of every byte,
    then writeback: on small VMs that CPU work, not the disk, bounds a multi-GB write (measured at
    5x slower than O_DIRECT on a 2-core VM), and it competes with the decode for the same cores.
    O_DIRECT needs the file offset, the length and the memory address of every write aligned to
    `ALIGN`. A tensor whose address is congruent to its file offset modulo ALIGN (`aligned_empty`)
    has its whole blocks written from its own memory: only the bytes that share a block with its
    neighbours (under ALIGN at each end) go through a staging buffer. Anything else is copied into
    one staging buffer while the I/O thread writes the other. The last partial block is written
    padded with zeros and the file truncated back to its size. Where the filesystem refuses
    O_DIRECT (at open, or EINVAL at the first write) the file falls back to ordinary writes.
    """

    def __init__(self, path: Path):
        self.path = path
        self._direct = hasattr(os, "O_DIRECT")
        try:
            self._fh = open(path, "wb", buffering=0, opener=open_direct if self._direct else None)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            self._direct = False
            self._fh = open(path, "wb")
        self._thread: threading.Thread | None = None
        self._written = 0  # bytes taken by `write`
        if not self._direct:
            return
        self._maps = [mmap.mmap(-1, STAGING_BYTES) for _ in range(2)]  # mmap memory is page-aligned
        self._staging = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self._free: queue.Queue = queue.Queue()  # staging buffers the caller may fill
        # (staging buffer index or None, memory, bytes) for the I/O thread; None ends it
        self._todo: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(IN_FLIGHT)  # for pieces written from their own memory
        self._free.put(1)
        self._cur, self._fill = 0, 0  # the buffer being filled, and how far
        self._flushed = 0  # bytes in the file (I/O thread)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="gptoss-direct-io", daemon=True)
        self._thread.start()

    def write(self, data) -> None:
        """Append `data` (bytes or a 1-D uint8 tensor, which must not change until close)."""
        if self._thread is None:
            self._fh.write(data if isinstance(data, bytes) else memoryview(data.numpy()))
            return
        self._raise_error()
        if isinstance(data, bytes):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        n = data.numel()
        head = min(n, -self._written % ALIGN)  # the bytes that complete the file's current block
        whole = (n - head) // ALIGN * ALIGN
        if whole and (data.data_ptr() - self._written) % ALIGN == 0:  # placed for its file offset
            self._stage(data[:head])
            if self._fill:  # the staged bytes end on a block boundary now
                self._submit_staging()
            self._slots.acquire()  # waits while IN_FLIGHT pieces are queued
            self._todo.put((None, data[head : head + whole], whole))
            self._stage(data[head + whole :])
        else:
            self._stage(data)
        self._written += n

    def _stage(self, data: torch.Tensor) -> None:
        """Copy `data` into the staging buffers, handing each full one to the I/O thread."""
        pos, n = 0, data.numel()
        while pos < n:
            k = min(n - pos, STAGING_BYTES - self._fill)
            self._staging[self._cur][self._fill : self._fill + k].copy_(data[pos : pos + k])  # releases the GIL
            self._fill += k
            pos += k
            if self._fill == STAGING_BYTES:
                self._submit_staging()

    def _submit_staging(self) -> None:
        self._todo.put((self._cur, self._staging[self._cur], self._fill))
        self._cur, self._fill = self._free.get(), 0  # waits while both buffers are in flight
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _drain(self) -> None:
        while (item := self._todo.get()) is not None:
            buffer, data, nbytes = item
            if self._error is None:
                try:
                    self._write_out(data, nbytes)
                except BaseException as exc:  # raised to the caller at its next write or close
                    self._error = exc
            del item, data  # a piece's memory is freed once written
            if buffer is None:
                self._slots.release()
            else:
                self._free.put(buffer)

    def _write_out(self, data: torch.Tensor, nbytes: int) -> None:
        view = memoryview(data.numpy())
        try:
            done = 0
            while done < nbytes:
                n = self._fh.write(view[done:nbytes])
                if not n:
                    raise OSError(errno.EIO, "write made no progress")
                done += n
        except OSError as exc:
            if exc.errno != errno.EINVAL or self._flushed or not self._direct:
                raise
            # the filesystem takes O_DIRECT at open but not for writes: write this file as usual
            self._fh.close()
            self._fh = open(self.path, "wb")
            self._fh.write(view[:nbytes])
            self._direct = False
        finally:
            view.release()
        self._flushed += nbytes

    def close(self) -> None:
        if self._thread is not None:
            try:
                if self._fill:
                    padded = min(-(-self._fill // ALIGN) * ALIGN, STAGING_BYTES)
                    self._staging[self._cur][self._fill : padded].zero_()
                    self._todo.put((self._cur, self._staging[self._cur], padded))
                self._todo.put(None)
                self._thread.join()
                self._thread = None
                self._raise_error()
                if self._flushed != self._written:  # the padded tail
                    self._fh.truncate(self._written)
            finally:
                self._fh.close()
                self._staging = self._maps = []  # unmapped once the last view is gone
            return
        self._fh.close()


__all__ = ["DirectFile", "DIRECT_MIN_BYTES", "aligned_empty", "open_direct"]
