"""Asynchronous training checkpoints (checkpoint.async_save): torch DCP's `async_save`, one save in flight,
published only once it is complete and verified.

A save copies what it saves to host memory on the training thread (train/staging.py's stager, handed to
DCP; the copy's buffers are kept from one save to the next, so every save after the first fills them in place) and writes the copy to
`.iter_N.partial` on DCP's upload thread while the next steps run. The upload's collectives (DCP's plan,
its write results) go over a gloo group of their own (`group`): the training thread's collectives never
interleave with them, and a CUDA run gets the CPU backend DCP's asynchronous path needs.

When is it published? At every step's end the ranks agree, in the one small all-reduce they already make
there (train/stop.py's `StepEnd`, shared with checkpoint.save_on_signal), on whether every rank's upload has
ended and whether any failed. Once all have ended, rank 0 reads the folder's `.metadata` back and checks
every shard file against it (`check_storage_files`), then writes train_state.json, renames the folder and
moves `latest` as a synchronous save does (checkpointing.publish_checkpoint, signals held), and retention
runs. A failed upload removes its folder and stops the run on every rank at the same step (CheckpointError,
exit 1). The next save, and the end of the run, wait for the one in flight: there is never more than one,
and its staged copy is the one `recipe/estimate/memory.py` counts.

How a run ends with a save in flight:
- normal end: the last save (at training.train_iters) is started, then waited for and published; the
  result names it.
- an error, Ctrl-C or SIGTERM inside the process (a single process or torchrun's ranks): `abandon()` waits
  for the upload (a write cannot be stopped halfway, and the interpreter would wait for DCP's thread at exit
  anyway; signals arriving meanwhile are held and re-raised after), then rank 0 publishes it if it
  completed (it holds the state of a finished step, checked finite before staging) or removes its folder if
  it failed. The stop message then names it as the last checkpoint.
- kill -9, an out-of-memory kill, a worker of `gptoss train --nproc-per-node N` ended by its launcher:
  nothing runs; the `.iter_N.partial` folder was never pointed to, `latest` names the last complete
  checkpoint, and the next run removes the folder (`remove_partial_checkpoints`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import shutil
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from gptoss_cli.checkpoint.formats.training.record import MODEL, OPTIMIZER, iter_name
from gptoss_cli.checkpoint.storage.dcp_io import check_storage_files, read_metadata
from gptoss_cli.checkpoint.storage.torch_bytes import signals_deferred
from gptoss_cli.errors import CheckpointError, signals_seen
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.train.staging import HostStager
from gptoss_cli.train.checkpointing import (
    check_finite_state, checkpoint_payload, partial_folder, prepare_folder, publish_checkpoint, save_failed,
)


# How long the upload's collectives wait for a peer: its last one waits for the slowest rank's whole write. A bound
# for a peer that died, far above any save's time (the training thread's collectives have their own).
UPLOAD_TIMEOUT_S = 1800.0


@dataclass
class InFlight:
    """A save whose upload was started: where it goes, what train_state.json will say, DCP's future."""

    ckpt_dir: Path
    step: int
    tmp: Path
    final: Path
    train_state: dict[str, Any]
    future: Any  # concurrent.futures.Future of DCP's save
    mark: int  # errors.signals_seen() when it started

    def ended(self) -> bool:
        return self.future.done()

    def failure(self) -> BaseException | None:
        """The upload's exception once it has ended (None: it succeeded)."""
        return self.future.exception() if self.future.done() else None


class AsyncCheckpointer:
    """checkpoint.async_save's saves of one rank (see the module docstring)."""

    def __init__(self, state: ParallelState, timeout_s: float = UPLOAD_TIMEOUT_S):
        self.state = state
        # the upload's collectives on a group of their own (gloo: DCP's asynchronous save needs a CPU backend)
        self.group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                      if state.distributed else None)
        self.stager = HostStager(pin_memory=state.device.type == "cuda")  # train/staging.py
        if not state.distributed:
            # DCP's "assuming ... a single process" warning, which quiet_single_process silences on this thread,
            # comes from the upload thread here: the one message is filtered for the process
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        self.pending: InFlight | None = None
        self.published: list[tuple[int, Path]] = []  # (step, folder) of each save published, in order

    # -- starting a save -------------------------------------------------------------------------------
    def save(self, ckpt_dir: str | Path, *, step: int, model: torch.nn.Module, optimizer: Any,
             train_state: dict[str, Any]) -> Path | None:
        """Stage the state of `step` and start its upload; the save before it is finished first (its folder,
        published now, is returned)."""
        published = self.wait()
        import torch.distributed.checkpoint as dcp

        ckpt_dir, state = Path(ckpt_dir), self.state
        tmp, final = partial_folder(ckpt_dir, step), ckpt_dir / iter_name(step)
        payload = checkpoint_payload(model, optimizer, state)
        check_finite_state(ckpt_dir, step, payload[MODEL], payload[OPTIMIZER], state)
        mark = signals_seen()
        try:
            prepare_folder(ckpt_dir, tmp, state)
            # held from the copy until the upload is recorded as in flight: a signal then leaves it to `abandon`
            with signals_deferred():
                future = dcp.async_save(payload, checkpoint_id=str(tmp), process_group=self.group,
                                        async_stager=self.stager, no_dist=not state.distributed)
                self.pending = InFlight(ckpt_dir, step, tmp, final, dict(train_state), future, mark)
        except BaseException as exc:
            if self.pending is not None:  # the upload runs: a signal after it started (abandon() finishes it)
                raise
            if state.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, Exception):  # the copy failed (out of host memory...)
                raise save_failed(ckpt_dir, tmp, step, exc, mark) from None
            raise
        return published

    # -- the step's end --------------------------------------------------------------------------------
    def local_state(self) -> tuple[int, int]:
        """(1 if this rank's upload is still running, 1 if it failed): what `StepEnd` all-reduces."""
        p = self.pending
        if p is None:
            return 0, 0
        return int(not p.ended()), int(p.ended() and p.failure() is not None)

    def settle(self, running: bool, failed: bool) -> Path | None:
        """The ranks' agreed state of the save in flight: publish it when every upload has ended (returns its
        folder), raise when one failed; nothing while one still runs."""
        if self.pending is None or (running and not failed):
            return None
        if failed:
            self._fail()
        return self._publish()

    def wait(self) -> Path | None:
        """Block until the save in flight has ended on every rank, then publish it (its folder) or raise."""
        if self.pending is None:
            return None
        self._wait_own()
        failed = self.pending.failure() is not None
        if self.state.distributed:  # every rank's outcome (DCP reports a failure to all; this makes it certain)
            flag = torch.tensor([int(failed)], device=self.state.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.state.global_group)
            failed = bool(flag.item())
        return self.settle(False, failed)

    # -- ending -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """The training loop's block: whatever ends it early (an error, a signal) goes through `abandon`;
        the staged copy's buffers are released when it ends."""
        try:
            yield
        except BaseException:
            self.abandon()
            raise
        finally:
            self.close()

    def abandon(self) -> None:
        """On the way out of a failed or stopped run (no collective: ranks may be anywhere): wait for this rank's
        upload; rank 0 publishes it if it completed, else removes its folder. Never raises for the upload;
        signals arriving meanwhile are raised when it is done."""
        p = self.pending
        if p is None:
            return
        with signals_deferred():
            self._wait_own()
            if self.state.rank == 0:
                if p.failure() is None and self._verified(p):
                    publish_checkpoint(p.ckpt_dir, p.tmp, p.final, p.step, p.train_state, self.state)
                    self.published.append((p.step, p.final))
                else:
                    shutil.rmtree(p.tmp, ignore_errors=True)
            self.pending = None

    def close(self) -> None:
        """Release the staged copy's buffers (when nothing is in flight; the stager stays usable)."""
        if self.pending is None:
            self.stager.close()

    # -- helpers ---------------------------------------------------------------------------------------
    def _wait_own(self) -> None:
        """Until this rank's upload has ended. Signals are held meanwhile and raised once it has (a handler's
        exception inside a Condition's bookkeeping can leave its lock held: torch_bytes.signals_deferred); the
        wait is bounded by the upload's collectives' timeout."""
        if self.pending is not None:
            with signals_deferred():
                concurrent.futures.wait([self.pending.future])

    def _verified(self, p: InFlight) -> bool:
        try:
            check_storage_files(p.tmp, read_metadata(p.tmp))
        except CheckpointError:
            return False
        return True

    def _fail(self) -> None:
        """Every rank: the upload failed somewhere. Its folder goes (rank 0), then the run stops (CheckpointError)."""
        p = self.pending
        self._wait_own()
        if self.state.rank == 0:
            shutil.rmtree(p.tmp, ignore_errors=True)
        self.pending = None
        exc = p.failure() or CheckpointError(f"{p.tmp}: the upload failed on another rank")
        raise save_failed(p.ckpt_dir, p.tmp, p.step, exc, p.mark)

    def _publish(self) -> Path:
        """Every upload has ended well: rank 0 checks the folder against its metadata and publishes it."""
        p = self.pending
        if self.state.rank == 0:
            try:
                check_storage_files(p.tmp, read_metadata(p.tmp))
            except CheckpointError:  # one line naming the first missing byte range; the folder goes
                shutil.rmtree(p.tmp, ignore_errors=True)
                self.pending = None
                raise
            publish_checkpoint(p.ckpt_dir, p.tmp, p.final, p.step, p.train_state, self.state)
        self.pending = None
        self.published.append((p.step, p.final))
        return p.final


__all__ = ["AsyncCheckpointer", "InFlight"]
