"""Appending to a file with O_DIRECT, past the page cache, through two staging buffers and an I/O thread.

`ShardedWriter` (safetensors_io.py) writes its large shards through `DirectFile`; the file falls
back to ordinary writes where the filesystem refuses O_DIRECT.
"""

from __future__ import annotations

import errno
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


def open_direct(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_DIRECT, 0o666)


class DirectFile:
    """A file written with O_DIRECT, through two page-aligned staging buffers.

    Writing through the page cache costs the kernel a copy and the page bookkeeping of every byte,
    then writeback: on small VMs that CPU work, not the disk, bounds a multi-GB write (measured at
    5x slower than O_DIRECT on a 2-core VM), and it competes with the decode for the same cores.
    Here the caller's thread copies data into one staging buffer while an I/O thread writes the
    other one to the disk. The last partial block is written padded with zeros and the file
    truncated back to its size. Where the filesystem refuses O_DIRECT (at open, or EINVAL at the
    first write) the file falls back to ordinary writes.
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
        self._todo: queue.Queue = queue.Queue()  # (buffer, bytes) for the I/O thread; None ends it
        self._free.put(1)
        self._cur, self._fill = 0, 0  # the buffer being filled, and how far
        self._flushed = 0  # bytes in the file (I/O thread)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="gptoss-direct-io", daemon=True)
        self._thread.start()

    def write(self, data) -> None:
        """Append `data` (bytes or a 1-D uint8 tensor)."""
        if self._thread is None:
            self._fh.write(data if isinstance(data, bytes) else memoryview(data.numpy()))
            return
        self._raise_error()
        if isinstance(data, bytes):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        pos, n = 0, data.numel()
        while pos < n:
            k = min(n - pos, STAGING_BYTES - self._fill)
            self._staging[self._cur][self._fill : self._fill + k].copy_(data[pos : pos + k])  # releases the GIL
            self._fill += k
            pos += k
            if self._fill == STAGING_BYTES:
                self._todo.put((self._cur, STAGING_BYTES))
                self._cur, self._fill = self._free.get(), 0  # waits while both buffers are in flight
                self._raise_error()
        self._written += n

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _drain(self) -> None:
        while (item := self._todo.get()) is not None:
            if self._error is None:
                try:
                    self._write_out(*item)
                except BaseException as exc:  # raised to the caller at its next write or close
                    self._error = exc
            self._free.put(item[0])

    def _write_out(self, i: int, nbytes: int) -> None:
        view = memoryview(self._maps[i])
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
                    self._todo.put((self._cur, padded))
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


__all__ = ["DirectFile", "DIRECT_MIN_BYTES", "open_direct"]
