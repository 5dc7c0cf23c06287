"""A simulated interconnect for the overlap benchmark: every all-to-all lasts `latency + bytes / bandwidth`.

On one CPU machine gloo's loopback is nearly free, so whether the EP overlap schedule hides
communication cannot be seen. `LinkComm(LinkModel(...))` is a communication object
(gptoss_cli/model/dispatcher.py, `Comm`) that wraps the real one: every all-to-all it carries (the
synchronous count exchange and token all-to-alls of the plain path, and the asynchronous ones the
overlap schedule issues) completes no earlier than its modelled finish time. `use_link(model, link)`
puts one on every token dispatcher of a model for the duration of a block. The wait is a sleep on
the communication side (inside the blocking call, or inside the work's `wait()`), never a busy
loop, so the other process and the compute of the waiting one keep the cores.

The model, per rank (a full-duplex link of `gbps` Gbit/s each way):
  * bytes of an all-to-all = max(bytes sent to other ranks, bytes received from them); rows that
    stay on the rank cost nothing;
  * token all-to-alls share the link first come, first served, like NCCL collectives on one
    communication stream: a transfer starts when the link is free, occupies it for
    bytes / bandwidth, and completes `latency` later (latency does not hold the link);
  * the count exchange (a few integers) is not queued behind bulk transfers: it pays
    latency + bytes / bandwidth from its issue (on GPUs Megatron runs it on the compute stream).
The real gloo collective runs inside the modelled time; a transfer completes at the later of the
two. Scaffolding of bench/overlap.py, bench/pipeline.py and tests/schedule/: the package never imports it.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist

from gptoss_cli.model.dispatcher import DIST_COMM, Comm


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


def wait_until(deadline: float | None) -> None:
    """Sleep (not spin) until the host clock reaches `deadline`."""
    if deadline is None:
        return
    left = deadline - time.perf_counter()
    while left > 0:
        time.sleep(left)
        left = deadline - time.perf_counter()


class LinkComm:
    """A communication object whose all-to-alls last at least what `link` models (wraps `inner`)."""

    def __init__(self, link: LinkModel, inner: Comm = DIST_COMM):
        self.link, self.inner = link, inner

    def _deadline(self, x: torch.Tensor, output_splits: list[int] | None, input_splits: list[int] | None,
                  group: Any, issued_at: float, queued: bool) -> float:
        """When the link lets this all-to-all complete: bytes = max(sent to, received from other ranks)."""
        me, world = dist.get_rank(group), dist.get_world_size(group)
        row_bytes = x.element_size() * (x[0].numel() if x.dim() > 1 else 1)
        rows = x.shape[0] if x.dim() else 1
        sent = (rows - input_splits[me]) if input_splits else rows - rows // world
        received = (sum(output_splits) - output_splits[me]) if output_splits else rows - rows // world
        return self.link.reserve(row_bytes * max(sent, received), issued_at, queued=queued)

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor, output_splits: list[int] | None,
                   input_splits: list[int] | None, group: Any, *, control: bool = False) -> None:
        issued = time.perf_counter()
        # the count exchange (control) is not queued behind bulk transfers
        deadline = self._deadline(x, output_splits, input_splits, group, issued, queued=not control)
        self.inner.all_to_all(out, x, output_splits, input_splits, group, control=control)
        wait_until(deadline)
        self.link.blocked_s += time.perf_counter() - issued

    def start_all_to_all(self, out: torch.Tensor, x: torch.Tensor, output_splits: list[int],
                         input_splits: list[int], group: Any) -> "_LinkWork":
        issued = time.perf_counter()
        deadline = self._deadline(x, output_splits, input_splits, group, issued, queued=True)
        work = self.inner.start_all_to_all(out, x, output_splits, input_splits, group)
        return _LinkWork(self.link, work, deadline, time.perf_counter() - issued)


class _LinkWork:
    """An asynchronous all-to-all under the link: `wait()` returns no earlier than its deadline."""

    def __init__(self, link: LinkModel, work: Any, deadline: float, issue_s: float):
        self.link, self.work, self.deadline, self.issue_s = link, work, deadline, issue_s

    def wait(self) -> None:
        started = time.perf_counter()
        self.work.wait()
        wait_until(self.deadline)
        self.link.blocked_s += time.perf_counter() - started + self.issue_s


def token_dispatchers(model: torch.nn.Module) -> list[Any]:
    """Every token dispatcher of `model` (wrappers included), each once."""
    found: dict[int, Any] = {}
    for module in model.modules():
        d = getattr(module, "token_dispatcher", None)
        if d is not None:
            found.setdefault(id(d), d)
    return list(found.values())


@contextlib.contextmanager
def use_link(model: torch.nn.Module, link: LinkModel | None) -> Iterator[LinkModel | None]:
    """Carry every all-to-all of `model`'s token dispatchers over `link` inside the block (None: the
    real network); their own communication objects come back afterwards."""
    dispatchers = token_dispatchers(model) if link is not None else []
    previous = [d.comm for d in dispatchers]
    for d in dispatchers:
        d.comm = LinkComm(link, d.comm)
    try:
        yield link
    finally:
        for d, comm in zip(dispatchers, previous):
            d.comm = comm


__all__ = ["LinkModel", "LinkComm", "use_link", "token_dispatchers", "wait_until"]
