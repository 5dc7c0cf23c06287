"""The end of a training step, agreed by every rank: checkpoint.save_on_signal's stop and the state of
checkpoint.async_save's upload, in one small all-reduce.

checkpoint.save_on_signal is Megatron's exit-signal handler (`--exit-signal-handler`): while the run
trains, SIGTERM (what SLURM sends before it kills a job) and SIGINT (Ctrl-C) do not stop the rank where it
stands; its handler only records the signal (`watching`). At the end of every step the ranks all-reduce
(MAX) what each has seen (`agree`), so a signal that reached one rank stops every rank after the same step:
the step is finished, the checkpoint of that step saved once (the loop, train/loop.py), and the run ends
as the signal asks, exit 143 for SIGTERM, 130 for SIGINT (SIGTERM wins when the ranks saw both). Without
it the CLI's handlers stay in place: the signal unwinds the rank at once and the steps since the last
checkpoint are lost (the stop message says how many).

The same all-reduce carries the asynchronous save's two flags (an upload still running on some rank, an
upload failed on some rank: train/async_save.py), so the ranks publish or fail a save at the same step.
One all-reduce of three integers per step, made only when either field is on; on CUDA it is one more host
sync per step (Megatron's handler makes the same one).

Signal handlers are Python's, so they run on the main thread only; `watching` installs nothing elsewhere.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from gptoss_cli.errors import Terminated
from gptoss_cli.parallel.state import ParallelState

WATCHED = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed at a step's end."""

    signum: int  # the signal to stop for (0: none); SIGTERM over SIGINT
    running: bool  # an asynchronous upload still runs on some rank
    failed: bool  # an asynchronous upload failed on some rank


def stop_exception(signum: int) -> BaseException:
    """What a run stopped by `signum` ends with (the CLI makes it exit 130 / 143)."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


class StepEnd:
    """One rank's side of the step-end agreement (see the module docstring)."""

    def __init__(self, state: ParallelState, *, save_on_signal: bool, async_save: bool):
        self.state = state
        self.save_on_signal = save_on_signal
        self.active = save_on_signal or async_save
        self.seen = 0  # the signal this rank's handler recorded (SIGTERM kept over SIGINT)

    def _record(self, signum: int, frame: Any) -> None:
        self.seen = max(self.seen, signum)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """With save_on_signal, SIGINT and SIGTERM only record themselves inside the block (main thread);
        the handlers before it are back when it ends."""
        if not self.save_on_signal or threading.current_thread() is not threading.main_thread():
            yield
            return
        before = {s: signal.getsignal(s) for s in WATCHED}
        try:
            for s in WATCHED:
                signal.signal(s, self._record)
            yield
        finally:
            for s, handler in before.items():
                signal.signal(s, handler)

    def agree(self, running: int = 0, failed: int = 0) -> Agreed:
        """Every rank's signal and upload flags, MAX-reduced over all ranks (a collective when distributed)."""
        values = [self.seen, running, failed]
        if self.state.distributed:
            flags = torch.tensor(values, dtype=torch.int64, device=self.state.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.state.global_group)
            values = flags.tolist()
        return Agreed(signum=int(values[0]), running=bool(values[1]), failed=bool(values[2]))


__all__ = ["Agreed", "StepEnd", "stop_exception", "WATCHED"]
