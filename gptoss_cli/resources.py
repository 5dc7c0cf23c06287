"""What this process uses: its peak resident memory (as convert, parity-check and the benches report it), and how glibc keeps freed memory."""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_bytes() -> int:
    """Peak resident memory of this process: VmHWM where Linux has it, because ru_maxrss carries the
    launching process's peak across exec (a bench's own peak would show up as every child's)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def keep_freed_memory() -> None:
    """Ask glibc to keep freed chunk buffers for reuse instead of unmapping them.

    Streaming allocates and frees a buffer of the same size for every chunk; by default glibc
    returns each large buffer to the OS and the next one page-faults in afresh, which measured
    as most of convert's decode time. Peak memory is unchanged: it is still one chunk's worth.
    A CPU training step allocates and frees the same activations every step: 40k page faults per
    step of the 512-wide bench config, 5-10% of its time (bench/train.py, docs/benchmarks.md).
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: serve chunk-sized buffers from the heap
        libc.mallopt(-1, 1 << 31)  # M_TRIM_THRESHOLD: do not hand freed heap back right away
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


__all__ = ["keep_freed_memory", "peak_rss_bytes"]
