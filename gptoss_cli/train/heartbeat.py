"""Per-step heartbeats of the training ranks and the watchdog that ends a job whose rank stops making progress.

Without it the only watchdog is the collective timeout (10 minutes): a rank that is stopped
(SIGSTOP, a frozen node) or stuck holds every other rank inside its next all-reduce until then.

Each worker has a `Heartbeat`: the training loop reports its progress (step and phase, at every
microbatch) from the main thread, and a daemon thread publishes it about once a second together
with its own clock reading, the liveness beat. A process that is stopped publishes nothing, so its liveness beat
ages; a process that is alive but stuck keeps beating while its progress ages.

- Local launches (`gptoss train` starting N workers): the beats are small files in a folder of
  the launcher, and the launcher's `Watchdog` thread reads them. When a rank in a step phase has
  not progressed for `timeout_s`, or any rank's liveness beat is that old, it names the culprit (a
  rank whose process no longer beats, else the rank whose progress is oldest), kills the workers,
  and the launch raises one error with that name.
- Under torchrun (no launcher of ours): each rank's heartbeat thread watches its own progress and
  ends its process with one line when it has not moved for `timeout_s`; torchrun then stops the job.

Long I/O phases (building the model, loading weights, saving a checkpoint) are reported as
unwatched: only a stopped process ends the job there, never a slow disk.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, TypeVar

T = TypeVar("T")

INTERVAL_S = 1.0
# A liveness beat older than this many intervals means the process is not running at all.
FROZEN_INTERVALS = 4


class Heartbeat:
    """One rank's heartbeat (see the module docstring); `progress()` is cheap enough to call every step."""

    def __init__(self, rank: int, timeout_s: float, directory: str | Path | None = None, *,
                 self_watch: bool = False, interval_s: float = INTERVAL_S):
        self.rank = rank
        self.timeout_s = timeout_s
        self.path = Path(directory) / f"rank{rank}.json" if directory else None
        self.self_watch = self_watch
        self.interval_s = interval_s
        self._state: dict[str, Any] = {"step": 0, "phase": "setup", "watched": False, "progress_time": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def progress(self, step: int, phase: str = "step", *, watched: bool = True) -> None:
        self._state = {"step": step, "phase": phase, "watched": watched, "progress_time": time.time()}

    def beating(self, items: Iterator[T], step: int) -> Iterator[T]:
        """`items` (a step's microbatches), reporting progress at each one: a long step is not a stall."""
        for item in items:
            self.progress(step, "step")
            yield item

    def start(self) -> "Heartbeat":
        if self.path is None and not self.self_watch:
            return self
        self._thread = threading.Thread(target=self._run, name=f"gptoss-heartbeat-rank{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            state = self._state
            now = time.time()
            if self.path is not None:
                self._publish({**state, "rank": self.rank, "pid": os.getpid(), "beat_time": now})
            if self.self_watch and state["watched"] and now - state["progress_time"] > self.timeout_s:
                sys.stderr.write(
                    f"error: worker rank {self.rank} made no progress for {now - state['progress_time']:.0f} s "
                    f"({describe_phase(state['phase'], state['step'])}; it or a rank it waits for is stuck or stopped); "
                    f"ending the job (system.heartbeat_timeout_s={self.timeout_s:g})\n"
                )
                sys.stderr.flush()
                os._exit(1)

    def _publish(self, record: dict[str, Any]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)
        except OSError:  # the launcher's folder is gone: the launcher is, too
            pass


def describe_phase(phase: str, step: int) -> str:
    """Where a rank was: 'during step 12', 'while saving the checkpoint of step 10', 'during setup'."""
    return {"step": f"during step {step}", "checkpoint save": f"while saving the checkpoint of step {step}",
            "setup": "during setup", "finishing": "at the end of the run"}.get(phase, f"in {phase} at step {step}")


def _process_state(pid: int) -> str:
    """Linux process state letter (R, S, D, T, Z, ...) or '?'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "?"


_GONE_STATES = ("T", "t", "Z")  # stopped, stopped by a tracer, exited: never transient ("D" can be)
_STATE_WORDS = {"T": "its process is stopped", "t": "its process is stopped by a tracer",
                "D": "its process is blocked in uninterruptible I/O", "Z": "its process has exited"}


class Watchdog:
    """The launcher side: reads the ranks' beat files, ends the job on a stall, and remembers why."""

    def __init__(self, directory: str | Path, timeout_s: float, *, poll_s: float = 0.5,
                 interval_s: float = INTERVAL_S):
        self.directory = Path(directory)
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.frozen_s = min(timeout_s, FROZEN_INTERVALS * interval_s)
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gptoss-watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _beats(self) -> dict[int, dict[str, Any]]:
        beats = {}
        for path in self.directory.glob("rank*.json"):
            try:
                record = json.loads(path.read_text())
                beats[int(record["rank"])] = record
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced right now; read it next time
        return beats

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            beats = self._beats()
            verdict = self.check(beats, time.time())
            if verdict is not None:
                self.reason = verdict
                for record in beats.values():  # the culprit may be stopped: only SIGKILL ends it
                    try:
                        os.kill(int(record["pid"]), signal.SIGKILL)
                    except (OSError, ValueError):
                        pass
                return

    def check(self, beats: dict[int, dict[str, Any]], now: float) -> str | None:
        """The error line when the job has stalled, else None."""
        if not beats:
            return None
        stalled = any(now - b["beat_time"] > self.timeout_s for b in beats.values()) or any(
            b["watched"] and now - b["progress_time"] > self.timeout_s for b in beats.values()
        )
        if not stalled:
            return None
        # A rank whose process is stopped or gone is the culprit even before its heartbeat file ages past
        # frozen_s: the progress rule can fire first (its step had been running for a while).
        frozen = [r for r, b in beats.items()
                  if now - b["beat_time"] > self.frozen_s or _process_state(int(b["pid"])) in _GONE_STATES]
        if frozen:
            rank = min(frozen, key=lambda r: beats[r]["beat_time"])
            b = beats[rank]
            why = _STATE_WORDS.get(_process_state(int(b["pid"])), "its process does not respond")
            why += f"; no heartbeat for {now - b['beat_time']:.0f} s"
        else:
            rank = min(beats, key=lambda r: beats[r]["progress_time"])
            b = beats[rank]
            why = f"it is alive but has not moved for {now - b['progress_time']:.0f} s"
        return (
            f"worker rank {rank} stopped making progress ({why}, {describe_phase(b['phase'], b['step'])}); "
            f"the job was ended (system.heartbeat_timeout_s={self.timeout_s:g})"
        )


__all__ = ["Heartbeat", "Watchdog"]
