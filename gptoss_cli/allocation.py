"""Memory that a user's file claims, checked before it is allocated; an allocation failure as one line naming what was read.

A header (a safetensors shard's, DCP's `.metadata`, a token file's) may claim any size, and a sparse
file even holds the bytes it claims: every check of the claim against the file's size then passes
and the claim reaches the allocator, whose failure (torch's RuntimeError "can't allocate memory",
numpy's or Python's MemoryError) named no file. So a reader that materialises what a file describes
goes through `claimed(what, nbytes, make, path)`:

- `check_claim` first: a claim above what this process could ever hold (`memory_ceiling_bytes`:
  physical memory plus swap, or less under an address-space or data limit) is refused before any
  allocation, as bad input (exit 2) when the file's allocated blocks hold less than the claim (a
  sparse file: the header is not describing data that is there), else as out of memory (exit 1);
- then the allocation inside `allocating(what)`, which turns the allocator's own failure into
  `OutOfMemory` naming `what` (a claim that fits the machine but not what is free right now).

`what` is the file and the tensor (or entry) being read. The CLI turns an allocation failure that
escaped every reader into one line too (cli/app.py), so none is ever a traceback. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from gptoss_cli.errors import OutOfMemory, UsageError, first_line

T = TypeVar("T")

# What the allocators say when they fail: torch's CPU allocator ("DefaultCPUAllocator: can't allocate
# memory"), CUDA's ("CUDA out of memory"), errno ENOMEM ("Cannot allocate memory") and numpy's.
_ALLOCATION_WORDS = ("can't allocate memory", "cannot allocate memory", "out of memory", "not enough memory",
                     "unable to allocate")


def memory_ceiling_bytes() -> int | None:
    """The most memory this process could ever hold: physical memory plus swap, lowered by an
    address-space or data-segment limit (RLIMIT_AS, RLIMIT_DATA); None where none of them is known."""
    bounds: list[int] = []
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        bounds.append(total + _swap_bytes())
    except (ValueError, OSError, AttributeError):
        pass
    for limit in (resource.RLIMIT_AS, getattr(resource, "RLIMIT_DATA", None)):
        if limit is None:
            continue
        try:
            soft = resource.getrlimit(limit)[0]
        except (ValueError, OSError):
            continue
        if soft != resource.RLIM_INFINITY and soft > 0:
            bounds.append(soft)
    return min(bounds) if bounds else None


def _swap_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("SwapTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def allocated_bytes(path: str | Path) -> int | None:
    """The bytes a file has on disk (its allocated blocks: less than its size when it is sparse); None
    where the file system does not say."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    blocks = getattr(st, "st_blocks", None)
    return None if blocks is None else blocks * 512


def check_claim(what: str, nbytes: int, path: str | Path | None = None) -> None:
    """Refuse, before allocating, a read of `nbytes` that this process could never hold (see the module
    docstring); `what` names the file and tensor, `path` the file whose blocks are compared."""
    ceiling = memory_ceiling_bytes()
    if ceiling is None or nbytes <= ceiling:
        return
    on_disk = allocated_bytes(path) if path is not None else None
    if on_disk is not None and on_disk < nbytes:
        raise UsageError(f"{what}: claims {nbytes} bytes, but the file holds only {on_disk} bytes of data on disk "
                         f"(a sparse or damaged file), and this machine could hold at most {ceiling}",
                         hint="the header does not describe data that is there; re-create or re-download the file")
    raise OutOfMemory(f"{what}: needs {nbytes} bytes, more than this machine's memory and swap allow ({ceiling})",
                      hint="run on a machine with more memory")


def is_allocation_failure(exc: BaseException) -> bool:
    """Whether `exc` is an allocator's failure: a MemoryError, or a RuntimeError saying memory ran out."""
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _ALLOCATION_WORDS)


def out_of_memory(what: str | None, exc: BaseException) -> OutOfMemory:
    """The one-line OutOfMemory for an allocator's failure `exc` while reading `what` (None: unknown)."""
    detail = first_line(exc) if str(exc).strip() else "the allocator failed"
    where = f"{what}: " if what else ""
    return OutOfMemory(f"{where}out of memory ({detail})",
                       hint="free memory, or run on a machine with more")


@contextlib.contextmanager
def allocating(what: str) -> Iterator[None]:
    """An allocator's failure inside the block as `OutOfMemory` naming `what`; anything else as it is."""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:
        if not is_allocation_failure(exc):
            raise
        raise out_of_memory(what, exc) from None


def claimed(what: str, nbytes: int, make: Callable[[], T], path: str | Path | None = None) -> T:
    """`make()` (an allocation of `nbytes` for what a file describes) after `check_claim`, inside `allocating`."""
    check_claim(what, nbytes, path)
    with allocating(what):
        return make()


__all__ = ["memory_ceiling_bytes", "allocated_bytes", "check_claim", "is_allocation_failure", "out_of_memory",
           "allocating", "claimed"]
