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
            for s, handler in before.items():
                signal.signal(s, handler)
        if arrived:
            signum = arrived.pop(0)
            arrived.clear()
            handler = before[signum]
            if callable(handler):
                handler(signum, None)  # raises (KeyboardInterrupt, Terminated) as if it had landed now
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)

    def check() -> None:
        if arrived:
            restore_and_raise()

    for s in HELD:
        signal.signal(s, lambda signum, frame: arrived.append(signum))
    try:
        yield check
    finally:
        restore_and_raise()


def save_bytes(obj: Any) -> memoryview:
    """torch.save(obj) as bytes (a view of the in-memory archive), with SIGINT and SIGTERM held meanwhile."""
    import torch  # noqa: PLC0415

    buf = io.BytesIO()
    with signals_held():
        torch.save(obj, buf)
    return buf.getbuffer()


__all__ = ["signals_held", "signals_deferred", "save_bytes"]
