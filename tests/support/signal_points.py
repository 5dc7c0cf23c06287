"""A signal delivered at a chosen point of a block of code: the Nth Python call event, counted, not timed.

`sys.setprofile` sees every Python function called on the main thread (those C++ calls back into
included, such as a file's `write` that torch's zip writer calls) and every C function Python calls
(`os.replace`, a file's `write`, `torch.save`). `count_points(fn)` runs `fn` once and returns how many
such events it had, and the event numbers of named landmarks (the first call of `os.replace`,
`torch.save`, ...); `signal_at(n, signum)` is a context manager that raises `signum` at event `n`
through the process's own handler (`signal.raise_signal`), as if the signal had arrived just then.
Python runs the handler at its next chance, which is inside whatever Python code runs next, a callback
from C++ included: the places where a handler's exception used to turn into a C++ error.

`sweep_points(total, landmarks, n)` picks n points spread over the block plus every landmark, so a
test interrupts a save at many places without timing luck. Events inside Python's own lock keeping
(threading, logging, queue, the import machinery) are never points: see `_LOCK_KEEPERS`. Signals land only on the main thread; the
events of other threads are not counted (a writer thread's work is reached through the main
thread's waits on it).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import Any, Callable, Iterator

# C functions whose first call in a save is a point worth hitting on purpose: the renames that publish,
# the writes, torch's own serialiser, the removal of a partial folder.
LANDMARKS = ("replace", "rename", "write", "fsync", "_save", "save", "rmtree", "mkdir", "open", "close")


# Python's own lock bookkeeping is not safe against an exception raised inside it (a handler's exception in
# logging's Handler.acquire, a Condition's __exit__ or the import machinery leaves a lock held or a module half
# imported): a signal there is CPython's hazard, not gptoss's, and it would leave the test process hung for the
# tests after it. Events in these files are counted but never chosen as points.
_LOCK_KEEPERS = ("/threading.py", "/logging/__init__.py", "/queue.py", "/concurrent/futures/", "<frozen importlib",
                 "/weakref.py", "/_weakrefset.py", "/contextlib.py")


def _eligible(frame: Any) -> bool:
    name = frame.f_code.co_filename
    return not any(k in name for k in _LOCK_KEEPERS)


def _name(event: str, frame: Any, arg: Any) -> str:
    if event == "c_call":
        return getattr(arg, "__name__", "")
    return frame.f_code.co_name


def count_points(fn: Callable[[], Any]) -> tuple[int, dict[str, int], Any]:
    """(events in `fn()`, {landmark: the event number of its first call}, fn's result)."""
    seen = {"n": 0}
    firsts: dict[str, int] = {}

    def profile(frame, event, arg):
        if event in ("call", "c_call") and _eligible(frame):
            seen["n"] += 1
            name = _name(event, frame, arg)
            if name in LANDMARKS and name not in firsts:
                firsts[name] = seen["n"]

    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return seen["n"], firsts, result


@contextlib.contextmanager
def signal_at(point: int, signum: int) -> Iterator[dict[str, Any]]:
    """Inside the block, raise `signum` (through the installed handler) at call event number `point`;
    yields a record whose "fired" says whether the point was reached (a block shorter than `point` is not
    interrupted) and "where" names the function being called then."""
    record: dict[str, Any] = {"fired": False, "where": None}
    seen = {"n": 0}

    def profile(frame, event, arg):
        if event in ("call", "c_call") and _eligible(frame):
            seen["n"] += 1
            if seen["n"] == point:
                sys.setprofile(None)
                record.update(fired=True, where=f"{_name(event, frame, arg)} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}"
                                                f":{frame.f_lineno})")
                signal.raise_signal(signum)

    sys.setprofile(profile)
    try:
        yield record
    finally:
        sys.setprofile(None)


def sweep_points(total: int, landmarks: dict[str, int], n: int) -> list[int]:
    """`n` points spread evenly over events 1..total, plus every landmark, in order, without repeats."""
    spread = {max(1, round(total * (i + 0.5) / n)) for i in range(n)}
    return sorted(spread | set(landmarks.values()))


__all__ = ["LANDMARKS", "count_points", "signal_at", "sweep_points"]
