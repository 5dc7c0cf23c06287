"""A simulated interconnect for the overlap benchmark: every all-to-all lasts `latency + bytes / bandwidth`.

On one CPU machine gloo's loopback is nearly free, so whether the EP overlap schedule hides
communication cannot be seen. With a link model installed (`use_link(LinkModel(...))`), every
all-to-all of the token dispatcher (model/dispatcher.py: the synchronous count exchange and token
all-to-alls of the plain path, and the asynchronous ones the overlap schedule issues) completes
no earlier than its modelled finish time. The wait is a sleep on the communication side (inside the
blocking call, or inside `AsyncAllToAll.wait()`), never a busy loop, so the other process and the
compute of the waiting one keep the cores.

The model, per rank (a full-duplex link of `gbps` Gbit/s each way):
  * bytes of an all-to-all = max(bytes sent to other ranks, bytes received from them); rows that
    stay on the rank cost nothing;
  * token all-to-alls share the link first come, first served, like NCCL collectives on one
    communication stream: a transfer starts when the link is free, occupies it for
    bytes / bandwidth, and completes `latency` later (latency does not hold the link);
  * the count exchange (a few integers) is not queued behind bulk transfers: it pays
    latency + bytes / bandwidth from its issue (on GPUs Megatron runs it on the compute stream).
The real gloo collective runs inside the modelled time; a transfer completes at the later of the
two.

`LINK` is None outside benchmarks and tests: the dispatcher's only cost is reading it.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class LinkModel:
    """Bandwidth in Gbit/s (inf: latency only) and latency in microseconds; accounts what it carried."""

    gbps: float
    latency_us: float = 0.0
    free_at: float = 0.0  # host clock when the queued transfers have left the link
    transfers: int = 0
    bytes_moved: int = 0
    modeled_s: float = 0.0  # sum over transfers of latency + bytes / bandwidth (the communication time)
    blocked_s: float = 0.0  # host time spent blocked on communication (issue calls, waits, sync collectives)
    counts: dict = field(default_factory=lambda: {"bulk": 0, "control": 0})

    def __post_init__(self) -> None:
        if not (self.gbps > 0) or self.latency_us < 0 or math.isnan(self.latency_us):
            raise ValueError(f"link model needs gbps > 0 and latency_us >= 0, got {self.gbps}, {self.latency_us}")

    def duration_s(self, nbytes: int) -> float:
        return self.latency_us * 1e-6 + nbytes * 8 / (self.gbps * 1e9)

    def reserve(self, nbytes: int, issued_at: float, *, queued: bool = True) -> float:
        """The modelled completion time (host clock) of a transfer of `nbytes` issued at `issued_at`."""
        wire = nbytes * 8 / (self.gbps * 1e9)
        start = max(issued_at, self.free_at) if queued else issued_at
        if queued:
            self.free_at = start + wire
        self.transfers += 1
        self.counts["bulk" if queued else "control"] += 1
        self.bytes_moved += nbytes
        self.modeled_s += wire + self.latency_us * 1e-6
        return start + wire + self.latency_us * 1e-6


LINK: LinkModel | None = None


def wait_until(deadline: float | None) -> None:
    """Sleep (not spin) until the host clock reaches `deadline`."""
    if deadline is None:
        return
    left = deadline - time.perf_counter()
    while left > 0:
        time.sleep(left)
        left = deadline - time.perf_counter()


@contextlib.contextmanager
def use_link(link: LinkModel | None) -> Iterator[LinkModel | None]:
    """Install `link` for every all-to-all of this process inside the block (None: the real network)."""
    global LINK
    previous, LINK = LINK, link
    try:
        yield link
    finally:
        LINK = previous


__all__ = ["LinkModel", "LINK", "use_link", "wait_until"]
