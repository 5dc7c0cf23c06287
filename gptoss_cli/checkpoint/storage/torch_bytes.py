"""torch.save into bytes, with Ctrl-C and SIGTERM held until it returns, so that a signal or a full disk is
never raised inside torch's C++ zip writer.

torch.save writing to a file calls the file's Python `write` from C++; a KeyboardInterrupt (or the CLI's
SIGTERM exception) raised by a signal handler inside that call, or an OSError such as ENOSPC, comes out of
the C++ writer as a RuntimeError with a C++ message (exit 1, a traceback) instead of as itself. So the
archive is built in memory (`save_bytes`, the handlers only recording what arrives meanwhile) and written
by the caller with a plain `file.write`, where both surface as themselves: 130 / 143 / one line naming the
file. A piece is one conversion chunk (tens of MB at most), so the copy is bounded.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading
from typing import Any, Callable, Iterator

HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM arriving inside the block take effect when it ends, through the handlers that
    were installed (KeyboardInterrupt, the CLI's Terminated), never inside it. Only the main thread can
    install handlers, and only there do Python's handlers run: elsewhere this holds nothing."""
    with signals_deferred():
        yield


@contextlib.contextmanager
def signals_deferred() -> Iterator[Callable[[], None]]:
    """`signals_held`, and the block may call the `check()` it is given at its safe points: a signal that
    arrived meanwhile is raised there (the handlers put back first). For a loop that waits on worker
    threads: a handler's exception raised inside a lock's bookkeeping (`Condition.__exit__` of a future
    or a queue) can leave that lock held, and the workers, then the interpreter's exit, wait for it forever."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    arrived: list[int] = []
    before = {s: signal.getsignal(s) for s in HELD}
    restored = False

    def restore_and_raise() -> None:
        nonlocal restored
        if not restored:
            restored = True
            _restore(list(before.items()))
        if arrived:
            signum = arrived.pop(0)
            arrived.clear()
            _forward(before[signum], signum, None)  # raises (KeyboardInterrupt, Terminated) as if it landed now

    def check() -> None:
        if arrived:
            restore_and_raise()

    def record(signum: int, frame: Any) -> None:
        if restored:  # left installed by a signal that ended the block mid-restore: act as the handler replaced
            _forward(before[signum], signum, frame)
        else:
            arrived.append(signum)

    try:  # installed inside the try: a signal landing between the two still gets both handlers put back
        for s in HELD:
            signal.signal(s, record)
        yield check
    finally:
        restore_and_raise()


def _forward(handler: Any, signum: int, frame: Any) -> None:
    """What `handler` (a saved signal handler) does with `signum`."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _restore(handlers: list[tuple[int, Any]]) -> None:
    """Put every handler back, each in the `finally` of the one before. A signal the first restored handler raises
    for can still land before the next call (Python checks for signals as a function starts): the handler left
    installed then forwards to the one it replaced (`record`), so no signal is lost."""
    if not handlers:
        return
    (signum, handler), rest = handlers[0], handlers[1:]
    try:
        signal.signal(signum, handler)
    finally:
        _restore(rest)


def save_bytes(obj: Any) -> memoryview:
    """torch.save(obj) as bytes (a view of the in-memory archive), with SIGINT and SIGTERM held meanwhile."""
    import torch  # noqa: PLC0415

    buf = io.BytesIO()
    with signals_held():
        torch.save(obj, buf)
    return buf.getbuffer()


__all__ = ["signals_held", "signals_deferred", "save_bytes"]
