"""Conversion's thread pipeline: worker threads compute output pieces, one writer takes them in order.

`convert()` cuts each job (a tensor group) into tasks; `Pipeline` runs them on `worker_count()`
threads and hands their pieces to the shard writer in task order, `StageClock` sums the busy seconds
of the read and transform stages, and `torch_threads` gives torch one intra-op thread while the
workers run, then the caller's setting back.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from gptoss_cli.checkpoint.storage.readers import RowReader

# A task computes some output pieces (name, tensor) on a worker thread; the pieces are written in
# task order. A task returns the pieces to write now and those held back until its job's
# `RELEASE_HELD` marker (MXFP4 scales follow all blocks of their stack in the file).
Piece = tuple[str, torch.Tensor]
Task = Callable[[], tuple[list[Piece], list[Piece]]]
RELEASE_HELD = object()


class StageClock:
    """Reads through to a checkpoint reader, and sums the busy seconds of the read and the
    transform (decode, re-layout, cast) stages over the worker threads."""

    def __init__(self, reader: RowReader):
        self._reader = reader
        self._lock = threading.Lock()
        self._local = threading.local()
        self.read_seconds = self.transform_seconds = 0.0
        self.read_bytes = 0

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        t = self._reader.read(name, start, stop)
        dt = time.perf_counter() - t0
        self._local.read_seconds = getattr(self._local, "read_seconds", 0.0) + dt
        with self._lock:
            self.read_seconds += dt
            self.read_bytes += t.numel() * t.element_size()
        return t

    def run(self, task: Task):
        self._local.read_seconds = 0.0
        t0 = time.perf_counter()
        out = task()
        dt = time.perf_counter() - t0 - self._local.read_seconds
        with self._lock:
            self.transform_seconds += dt
        return out


def worker_count() -> int:
    """Threads that read and transform: one per core, at most eight.

    The shard writer needs little CPU (with O_DIRECT it mostly waits for the disk), so it does
    not get a core of its own: on 2 cores, 2 workers converted 1.25x faster than 1. Eight
    already outrun any disk (each decodes MXFP4 at gigabytes per second), and each holds a task's
    output, so more would only add memory.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


class Pipeline:
    """Runs tasks on worker threads and hands their pieces to `write` in task order.

    At most `depth` tasks are queued, running or finished but not yet written, which bounds
    memory by a few tasks' output (plus the writer's own queue). torch's gather, copy and file
    reads release the GIL, so the workers and the writer thread run in parallel.

    Jobs start in order: the tasks of one job (the expert chunks of a stack) run in parallel, and
    the next job's tasks start once they have all finished, so an error or an interrupt stops the
    conversion at the job where it happened, with nothing computed past it.
    """

    def __init__(self, write: Callable[[str, torch.Tensor], None], workers: int, clock: StageClock):
        self._write = write
        self._clock = clock
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gptoss-convert")
        self._depth = 2 * workers + 1
        self._pending: deque = deque()  # (future or RELEASE_HELD, callback once written)
        self._held: dict[str, list[torch.Tensor]] = {}

    def next_job(self) -> None:
        """Wait until every submitted task has finished (the writer keeps writing meanwhile);
        raise the first error among them, in task order."""
        futures = [item for item, _ in self._pending if item is not RELEASE_HELD]
        wait(futures)
        for f in futures:
            f.result()

    def submit(self, task, done: Callable[[], None] | None = None) -> None:
        item = task if task is RELEASE_HELD else self._pool.submit(self._clock.run, task)
        self._pending.append((item, done))
        while len(self._pending) > self._depth:
            self._retire()

    def _retire(self) -> None:
        item, done = self._pending.popleft()
        if item is RELEASE_HELD:
            for name, chunks in self._held.items():
                for t in chunks:
                    self._write(name, t)
            self._held.clear()
        else:
            now, held = item.result()
            for name, t in now:
                self._write(name, t)
            for name, t in held:
                self._held.setdefault(name, []).append(t)
        if done is not None:
            done()

    def finish(self) -> None:
        while self._pending:
            self._retire()
        self._pool.shutdown()

    def abort(self) -> None:
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` inside the block, and put back as it was on exit
    (error or not): the process's setting belongs to the caller.

    Conversion runs with one torch thread per worker: intra-op thread teams of several workers
    would contend for the same cores, and a team waits at its barrier for its slowest thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


__all__ = ["Piece", "Task", "RELEASE_HELD", "StageClock", "Pipeline", "worker_count", "torch_threads"]
