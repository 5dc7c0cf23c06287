"""What this process uses: its peak resident memory (as convert, parity-check and the benches report it), the host's
memory, and how glibc keeps freed memory and when a training step hands it back."""

from __future__ import annotations

import functools
import os
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


# What `keep_freed_memory` sets, as the benches print it.
ALLOCATOR_SETTING = "glibc keeping freed memory (M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD 2 GiB)"


def available_memory_bytes() -> int | None:
    """The host's available memory (Linux MemAvailable: free plus reclaimable caches); None where it is unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@functools.cache
def total_memory_bytes() -> int | None:
    """The host's total memory (Linux MemTotal), read once; None where it is unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@functools.cache
def _glibc():
    """glibc's allocator controls (ctypes), loaded once; None where the C library is not glibc."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def release_freed_heap() -> None:
    """Hand the free pages of glibc's heaps back to the OS (`malloc_trim(0)`), keeping what is live.

    A CPU training step frees gigabytes of tensors of many sizes; glibc serves most of them from
    its heaps (its mmap threshold rises to 32 MiB as large buffers are freed) and keeps the free
    pages between the live chunks resident. Over a run the resident set grows though the live
    memory does not: a 2-block model with the 201,088-token vocabulary went from 2.2 GB in the
    first quarter of 80 steps to 2.9 GB in the last, against an estimate of 1.9 GB
    (bench/memory.py). The trainer calls it through `HeapRelease`. Not glibc: nothing to do.
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def resident_bytes() -> int | None:
    """This process's resident set now (Linux /proc/self/statm); None where it is unknown."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None


# How much the resident set may grow after a step before the heap's free pages are handed back.
HEAP_RELEASE_GROWTH_BYTES = 256 << 20
# The environment variable that overrides it, in bytes; 0 hands them back after every step (before issue 55).
HEAP_RELEASE_ENV = "GPTOSS_HEAP_RELEASE_GROWTH"


class HeapRelease:
    """After each CPU training step, glibc's free heap pages handed back to the OS (`release_freed_heap`)
    only once the resident set has grown by `growth` bytes (HEAP_RELEASE_GROWTH_BYTES, 256 MiB, or
    $GPTOSS_HEAP_RELEASE_GROWTH) since the last hand-back; the first step's always (the baseline).

    Handing them back after every step bounded the resident set, but the next step faulted the same
    pages in again: a tiny model's step paid 5,500 minor faults and 12 ms of system time for it, a
    third of its step (bench/train.py, issue 55). A step whose tensors are reused (the LM head's
    chunks, model/workspace.py) grows nothing, and a heap that does fragment is still cut back
    within the stated growth. Where the resident set cannot be read, every step (as before)."""

    def __init__(self, growth: int | None = None):
        if growth is None:
            growth = int(os.environ.get(HEAP_RELEASE_ENV, HEAP_RELEASE_GROWTH_BYTES))
        self.growth = growth
        self.baseline: int | None = None
        self.releases = 0

    def after_step(self) -> bool:
        """Hand the free heap back if due; whether it did."""
        rss = resident_bytes()
        if self.baseline is not None and rss is not None and rss - self.baseline < self.growth:
            return False
        release_freed_heap()
        self.releases += 1
        self.baseline = resident_bytes()
        return True


def keep_freed_memory() -> None:
    """Ask glibc to keep freed chunk buffers for reuse instead of unmapping them (process-wide).

    For streaming, where it is bounded: convert allocates and frees a buffer of the same size for
    every chunk; by default glibc returns each large buffer to the OS and the next one
    page-faults in afresh, which measured as most of convert's decode time. Peak memory is
    unchanged: it is still one chunk's worth (bench/convert.py prints it).

    Not for training: a step allocates tensors of many sizes, and long-lived small allocations land
    between the freed large ones. With every buffer below 1 GiB served from the heap and nothing
    handed back, the heap fragments: a 2-block model with the 201,088-token vocabulary grew a
    worker by 250-300 MB per step (5 GB by step 14, 97% of it free heap) where glibc's defaults
    stay at 2-3 GB (bench/memory.py, docs/benchmarks.md). `gptoss train` leaves the allocator as
    glibc sets it and hands the heap's free pages back once it has grown (`HeapRelease`).
    """
    libc = _glibc()
    if libc is not None:  # not glibc: nothing to tune
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: serve chunk-sized buffers from the heap
        libc.mallopt(-1, 1 << 31)  # M_TRIM_THRESHOLD: do not hand freed heap back right away


__all__ = ["ALLOCATOR_SETTING", "HEAP_RELEASE_ENV", "HEAP_RELEASE_GROWTH_BYTES", "HeapRelease", "available_memory_bytes",
           "keep_freed_memory", "peak_rss_bytes", "release_freed_heap", "resident_bytes", "total_memory_bytes"]
