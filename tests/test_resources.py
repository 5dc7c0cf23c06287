"""gptoss_cli/resources.py: `release_freed_heap` hands the free pages between live heap chunks back to the OS
(what kept a CPU worker's resident set growing over a run), and the trainer's `HeapRelease` calls it only
once the resident set has grown by the stated amount."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gptoss_cli import resources

# In a fresh interpreter: glibc set as it ends up during a training run (its mmap threshold risen
# above 1 MiB, so 1 MiB blocks come from the heap; its trim threshold not reached), 256 MiB of 1 MiB
# blocks written with a small live allocation after each (so freeing them leaves holes, not a free
# top of the heap that glibc would trim by itself), the blocks freed: the resident set before and
# after release_freed_heap.
_SCRIPT = """
import ctypes, pathlib
from gptoss_cli.resources import release_freed_heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 64 << 20)
libc.mallopt(-1, 1 << 30)
def rss():
    return [int(l.split()[1]) * 1024 for l in pathlib.Path("/proc/self/status").read_text().splitlines()
            if l.startswith("VmRSS")][0]
blocks, live = [], []
for _ in range(256):
    p = libc.malloc(1 << 20)
    ctypes.memset(p, 1, 1 << 20)
    blocks.append(p)
    live.append(libc.malloc(64))
for p in blocks:
    libc.free(p)
before = rss()
release_freed_heap()
print(before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_freed_heap_returns_the_holes_between_live_chunks():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True)
    released = int(out.stdout.strip().splitlines()[-1])
    assert released >= 200 << 20, f"released {released / 2**20:.0f} MiB of 256 MiB of free heap"


def test_the_heap_is_handed_back_after_the_first_step_and_then_only_once_it_has_grown(monkeypatch):
    mib = 1 << 20
    rss = [500 * mib]
    calls = []
    monkeypatch.setattr(resources, "resident_bytes", lambda: rss[0])
    monkeypatch.setattr(resources, "release_freed_heap", lambda: calls.append(rss[0]))
    heap = resources.HeapRelease(growth=256 * mib)
    for grown_to in (500, 600, 755, 757, 700, 1013, 1014):
        rss[0] = grown_to * mib
        heap.after_step()
    # the first step sets the baseline (500); 757 is 257 MiB over it; 1013 is 256 MiB over 757
    assert calls == [500 * mib, 757 * mib, 1013 * mib] and heap.releases == 3


def test_growth_zero_hands_the_heap_back_after_every_step(monkeypatch):
    monkeypatch.setenv(resources.HEAP_RELEASE_ENV, "0")
    calls = []
    monkeypatch.setattr(resources, "release_freed_heap", lambda: calls.append(1))
    heap = resources.HeapRelease()
    for _ in range(3):
        heap.after_step()
    assert heap.growth == 0 and len(calls) == 3
