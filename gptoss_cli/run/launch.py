"""`gptoss train`'s library entry: validate the recipe with the shared rules, then launch the workers.

Before any process starts, the recipe goes through the same rule registry as `validate-config`
(`gptoss_cli.recipe.validate.preflight`, with the real world size and path checks); an error
stops it there, as do more ranks on this node than visible GPUs for a CUDA run (one line, exit 2:
ranks would otherwise share a GPU and NCCL fail later). Then:
- inside a torchrun-started process (RANK/WORLD_SIZE/LOCAL_RANK set): train in this process, so
  multi-node jobs are plain `torchrun --nnodes ... -m gptoss_cli train --recipe R`;
- one process: train in this process;
- N processes on this node: torch.distributed's elastic launcher (the machinery behind torchrun)
  starts N workers. A worker that fails makes the agent stop the others; the job then raises one
  error naming the failed rank and its message, never a hang. A heartbeat watchdog
  (`gptoss_cli.train.heartbeat`) ends the job when a rank stops making progress for
  `system.heartbeat_timeout_s`, naming that rank. Ctrl-C and SIGTERM stop the workers and end as
  KeyboardInterrupt / Terminated (the CLI prints one line, exit 130 / 143).

Pre-flight, before any process starts, the run takes a lock on `checkpoint.dir` and on the run
folder (a second run on the same folders fails at once; the lock of a killed run is taken over),
which also proves both folders writable, and removes incomplete checkpoints that killed runs left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from gptoss_cli import errors
from gptoss_cli.errors import ConfigError, GptossError, Terminated, TrainingError
from gptoss_cli.outputs import FolderLock
from gptoss_cli.parallel.state import check_local_gpus, torchrun_env
from gptoss_cli.run.worker import run_worker
from gptoss_cli.train.heartbeat import Watchdog
from gptoss_cli.train.job import TrainJob
from gptoss_cli.train.progress import TrainProgress, TrainResult
from gptoss_cli.train.report import METRICS
from gptoss_cli.train.resume import check_resume_point

if TYPE_CHECKING:
    from gptoss_cli.recipe.load import Recipe
    from gptoss_cli.recipe.validate import ValidationReport


def default_nproc(recipe: Recipe) -> int:
    """Processes on this node when --nproc-per-node is not given: the recipe's world size."""
    from gptoss_cli.recipe.estimate.sizes import resolve_world_size

    p = recipe.config.parallelism
    if p.nodes not in (None, 1):
        raise ConfigError(
            f"parallelism.nodes={p.nodes}: multi-node jobs start under torchrun",
            hint="run `torchrun --nnodes N --nproc-per-node G ... -m gptoss_cli train --recipe R` on every node",
        )
    return resolve_world_size(recipe.config)[0]


def preflight_recipe(recipe: Recipe, world_size: int) -> ValidationReport:
    """The shared rules with the launch world size and path checks; ValidationFailed stops the launch."""
    from gptoss_cli.recipe.validate import preflight
    from gptoss_cli.train.loggers import check_backends

    check_backends(recipe.config.logging)  # a missing TensorBoard / W&B package: one line, before any process
    gpu = None
    if recipe.config.system.gpu == "auto":
        gpu = _detect_gpu(recipe.config.system.device)
    return preflight(recipe, world_size=world_size, gpu=gpu)


def _detect_gpu(device: str) -> str:
    import torch

    from gptoss_cli.recipe.environment import gpu_from_device_name

    if device == "cpu" or not torch.cuda.is_available():
        return "none"
    return gpu_from_device_name(torch.cuda.get_device_name())


def train(recipe: Recipe, *, nproc_per_node: int | None = None, progress: TrainProgress | None = None) -> TrainResult:
    """Validate, then train: in this process (torchrun or one process) or on N local workers; then, when the
    recipe asks (`serve_check.engine`), check the final checkpoint against the serving engine."""
    result = _train(recipe, nproc_per_node=nproc_per_node, progress=progress)
    if recipe.config.serve_check.engine and int(os.environ.get("RANK", "0")) == 0:
        _serve_check(recipe.config.serve_check, result)
    return result


def _serve_check(section: Any, result: TrainResult) -> None:
    """serve-check the final checkpoint into the run folder; a failed check is a TrainingError (exit 1)."""
    from gptoss_cli.parity.serve.check import check_after_training

    if not result.checkpoint:
        raise TrainingError("serve_check: the run saved no checkpoint to check")
    report, path = check_after_training(result.checkpoint, result.run_dir, section.engine, section.engine_python,
                                        section.dtype)
    failure = report.failure_line()
    if failure is not None:
        raise TrainingError(f"serve_check ({path}): {failure}",
                            hint=f"the checkpoint {result.checkpoint} is saved; see docs/serve-check.md")
    worst = report.overall()["max_abs_logprob_diff"]
    result.notes.append(f"serve-check passed ({report.engine['name']} {report.engine['version']}, {report.dtype}, "
                        f"max |dlogprob| {worst:.3g}): {path}")


def _train(recipe: Recipe, *, nproc_per_node: int | None, progress: TrainProgress | None) -> TrainResult:
    env = torchrun_env()
    if env is not None:
        if nproc_per_node is not None and int(os.environ.get("LOCAL_WORLD_SIZE", nproc_per_node)) != nproc_per_node:
            raise ConfigError(
                f"--nproc-per-node {nproc_per_node} disagrees with torchrun's LOCAL_WORLD_SIZE={os.environ['LOCAL_WORLD_SIZE']}",
                hint="drop --nproc-per-node when running under torchrun",
            )
        preflight_recipe(recipe, env["WORLD_SIZE"])
        check_local_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), recipe.config.system.device)
        job = TrainJob.from_recipe(recipe)
        with run_folders(job, owner=env["RANK"] == 0) as notes, reporting_stop(job):
            done = nothing_to_do(job, check_resume_point(job.config), env["WORLD_SIZE"])
            return _with_notes(done or run_worker(job, progress), notes)
    nproc = nproc_per_node if nproc_per_node is not None else default_nproc(recipe)
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node {nproc} must be at least 1")
    preflight_recipe(recipe, nproc)
    check_local_gpus(nproc, recipe.config.system.device)
    job = TrainJob.from_recipe(recipe)
    with run_folders(job) as notes, reporting_stop(job):
        # Holding the folders: a resume that would change the lr schedule or the data is one line,
        # before any worker starts; so is a run already at training.train_iters.
        done = nothing_to_do(job, check_resume_point(job.config), nproc)
        if done is not None:
            return _with_notes(done, notes)
        if nproc == 1:
            return _with_notes(run_worker(job, progress), notes)
        return _with_notes(launch_local(job, nproc, progress), notes)


def nothing_to_do(job: TrainJob, resume: tuple[Path, dict[str, Any]] | None, world_size: int) -> TrainResult | None:
    """The result of a run whose checkpoint is already at training.train_iters (`resume`: the checkpoint it
    would resume and its train state, check_resume_point's): no worker starts, and the note says so and how
    to train longer; None when there are steps to train."""
    if resume is None:
        return None
    folder, saved = resume
    step, t = int(saved["step"]), job.config.training
    if step < t.train_iters:
        return None
    schedule = saved.get("lr_schedule") if isinstance(saved.get("lr_schedule"), dict) else {}
    keep = ""
    if schedule.get("style") not in (None, "constant") and t.lr_decay_iters is None:
        keep = (f" with training.lr_decay_iters={schedule.get('decay_iters')} to keep the checkpoint's learning-rate "
                "schedule (later steps run at min_lr)")
    note = (f"nothing to do: already at step {step} ({folder}), and training.train_iters={t.train_iters}; to train "
            f"longer, raise training.train_iters{keep}")
    return TrainResult(steps=0, final_step=step, losses=[], grad_norms=[], tokens_per_s=0.0, run_dir=str(job.run_dir),
                       checkpoint=str(folder), resumed_from=str(folder), world_size=world_size,
                       ep_size=job.config.parallelism.expert_model_parallel_size, notes=[note])


@contextlib.contextmanager
def reporting_stop(job: TrainJob) -> Iterator[None]:
    """A run stopped by Ctrl-C or SIGTERM ends as the same KeyboardInterrupt / Terminated, its message saying
    what survives (`what_survives`): the CLI prints it after "interrupted:" / "terminated:"."""
    metrics = Path(job.run_dir) / METRICS
    try:
        start = metrics.stat().st_size  # this run's steps are the lines appended from here
    except OSError:
        start = 0
    try:
        yield
    except (KeyboardInterrupt, Terminated) as exc:
        raise type(exc)(what_survives(job, _last_step(metrics, start))) from None


def _last_step(metrics: Path, start: int) -> int | None:
    """The last step metrics.jsonl logged after byte `start` (this run's), None when it logged none."""
    try:
        with metrics.open("rb") as fh:
            fh.seek(start)
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):  # a line cut by the stop does not parse: the one before it counts
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return None


def what_survives(job: TrainJob, last_step: int | None) -> str:
    """'nothing was left half-written; last checkpoint: step N (folder)' or 'none ...', and the steps this run
    finished since that checkpoint, which a resume does again."""
    from gptoss_cli.checkpoint.formats.training.record import latest_checkpoint

    ckpt_dir = job.config.checkpoint.dir
    try:
        folder = latest_checkpoint(ckpt_dir) if ckpt_dir else None
    except GptossError:
        folder = None
    saved = int(folder.name[len("iter_"):]) if folder is not None else None
    if saved is None:
        where = "checkpoint.dir is not set" if not ckpt_dir else f"none saved in {ckpt_dir} yet"
        text = f"nothing was left half-written; last checkpoint: none ({where})"
        lost = last_step if last_step is not None else 0
        return text + (f"; the {_steps(lost)} of this run are lost" if lost else "")
    text = f"nothing was left half-written; last checkpoint: step {saved} ({folder})"
    if (last_step is None or last_step <= saved) and _saved_on_signal(folder):
        return text + ", saved on the signal (checkpoint.save_on_signal): no step was lost"
    if last_step is None or last_step <= saved:
        return text + "; no step since is lost"
    lost = last_step - saved
    since = f"step {last_step}" if lost == 1 else f"steps {saved + 1}-{last_step}"
    return text + f"; {_steps(lost)} since ({since}) {'is' if lost == 1 else 'are'} lost (a resume trains them again)"


def _saved_on_signal(folder: Path) -> bool:
    """Whether the checkpoint `folder` was saved because a signal stopped the run (its train_state.json says)."""
    from gptoss_cli.checkpoint.formats.training.record import read_train_state

    try:
        return read_train_state(folder).get("saved_on") == "signal"
    except GptossError:
        return False


def _steps(n: int) -> str:
    return f"{n} step{'s' * (n != 1)}"


@contextlib.contextmanager
def run_folders(job: TrainJob, owner: bool = True) -> Iterator[list[str]]:
    """Lock checkpoint.dir and the run folder for this run (pre-flight: proves them writable) and remove
    the incomplete checkpoints killed runs left there; yields notes on what was removed.

    Under torchrun only global rank 0 (`owner`) does this: the folders are shared by all ranks.
    """
    from gptoss_cli.train.checkpointing import remove_partial_checkpoints

    if not owner:
        yield []
        return
    ckpt_dir = job.config.checkpoint.dir
    folders = [("logging.run_dir", Path(job.run_dir))]
    if ckpt_dir:
        folders.insert(0, ("checkpoint.dir", Path(ckpt_dir)))
    locks: list[FolderLock] = []
    seen: set[Path] = set()
    try:
        for what, folder in folders:
            resolved = folder.expanduser().resolve()
            if resolved not in seen:
                seen.add(resolved)
                locks.append(FolderLock(folder.expanduser(), what).acquire())
        notes = remove_partial_checkpoints(Path(ckpt_dir).expanduser()) if ckpt_dir else []
        yield notes
    finally:
        for lock in locks:
            lock.release()


def _with_notes(result: TrainResult, notes: list[str]) -> TrainResult:
    result.notes = list(notes) + list(result.notes)
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}  # what a process a signal stopped exits with (128 + signum)


def _exit_on_interrupt(signum: int, frame: Any) -> None:
    # Ctrl-C reaches every worker twice (from the terminal, then from the agent stopping them);
    # unwinding a KeyboardInterrupt through DCP threads and gloo teardown can print tracebacks and
    # takes seconds. Nothing a worker holds needs its cleanup: an unfinished checkpoint is a
    # `.iter_*.partial` folder that the next run removes, and the launcher reports the interrupt.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(130)


def _worker_entry(job: TrainJob, progress: TrainProgress | None) -> TrainResult:
    """Body of one elastic worker: a GptossError is recorded for the agent as one line, no traceback; a run
    stopped by a signal after its save (checkpoint.save_on_signal) exits 130 / 143, which the launcher reports
    as the signal."""
    signal.signal(signal.SIGINT, _exit_on_interrupt)
    try:
        return run_worker(job, progress)
    except (KeyboardInterrupt, Terminated) as exc:
        raise SystemExit(SIGNAL_EXIT[signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM]) from None
    except (GptossError, OSError) as exc:  # an OSError (full disk, unwritable metrics) is one line naming the path
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        if isinstance(exc, OSError):
            exc = errors.file_system_error(exc)
        ErrorHandler().record_exception(exc)
        raise SystemExit(exc.exit_code) from None
    except BaseException as exc:  # a bug: record it for the agent, keep the traceback on stderr
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
        raise


def launch_local(job: TrainJob, nproc: int, progress: TrainProgress | None = None, *, timeout_s: float = 900) -> TrainResult:
    """Start `nproc` workers on this node with the elastic launcher; rank 0's result."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from torch.distributed.elastic.multiprocessing.api import SignalException

    options: dict[str, Any] = {}
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        # Workers die on SIGTERM at once unless they are stopped; do not wait 30 s for those. With
        # checkpoint.save_on_signal they finish the step and save first: they get a rank's heartbeat budget.
        ckpt = job.config.checkpoint
        options["shutdown_timeout"] = (max(5, int(job.config.system.heartbeat_timeout_s))
                                       if ckpt.dir and ckpt.save_on_signal else 5)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"gptoss-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", rdzv_configs={"timeout": int(timeout_s)},
        max_restarts=0, monitor_interval=0.1, start_method="spawn", **options,
    )
    # The agent logs each worker exit and signal with tracebacks of its own; we report the failed
    # worker's error as one line instead (a worker that hit a bug prints its own traceback). Its
    # loggers set their own levels, so each one is quietened, not just the parent.
    names = [n for n in logging.root.manager.loggerDict if n.startswith(("torch.distributed.elastic",
                                                                         "torch.multiprocessing"))]
    quiet = [logging.getLogger(n) for n in ["torch.distributed.elastic", "torch.multiprocessing.spawn", *names]]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.CRITICAL)
    oom_before = oom_kills()
    beats = tempfile.mkdtemp(prefix="gptoss-heartbeat-")
    job = dataclasses.replace(job, heartbeat_dir=beats)
    try:
        with Watchdog(beats, job.config.system.heartbeat_timeout_s) as watchdog:
            try:
                results = elastic_launch(config, _worker_entry)(job, progress)
            except ChildFailedError as exc:
                if watchdog.reason:
                    raise TrainingError(watchdog.reason) from None
                rank, failure = exc.get_first_failure()
                stopped = {code: signum for signum, code in SIGNAL_EXIT.items()}.get(failure.exitcode)
                if stopped is not None:  # the ranks stopped for a signal one of them got (checkpoint.save_on_signal)
                    raise (KeyboardInterrupt if stopped == signal.SIGINT else Terminated)() from None
                raise _worker_error(rank, failure, oom_before) from None
            except SignalException as exc:  # the agent has stopped the workers
                if exc.sigval == signal.SIGINT:
                    raise KeyboardInterrupt from None
                raise Terminated() from None
    finally:
        shutil.rmtree(beats, ignore_errors=True)
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    return results[0]


def oom_kills(vmstat: str = "/proc/vmstat") -> int | None:
    """How many processes the kernel's out-of-memory killer has killed since boot (Linux's `oom_kill`
    counter), None where the kernel does not say."""
    try:
        with open(vmstat) as fh:
            for line in fh:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _oom_error(rank: int, oom_before: int | None) -> TrainingError | None:
    """A worker ended by SIGKILL: out of memory when the kernel's OOM killer fired during the run."""
    after = oom_kills()
    hint = ("`gptoss validate-config` prints the memory estimate per process: lower training.micro_batch_size, "
            "training.seq_length or the processes on this host, or use one with more memory")
    if oom_before is not None and after is not None and after > oom_before:
        return TrainingError(f"worker rank {rank} ran out of memory: the kernel's out-of-memory killer ended it "
                             "(SIGKILL)", hint=hint)
    return None


def _worker_error(rank: int, failure: Any, oom_before: int | None = None) -> GptossError:
    """The failed worker's own error type and message when it recorded one; out of memory when the
    kernel's OOM killer ended it (SIGKILL and its kill counter went up); else TrainingError."""
    if failure.exitcode == -signal.SIGKILL:
        oom = _oom_error(rank, oom_before)
        if oom is not None:
            return oom
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    message = str(message).strip().splitlines()[0] if str(message).strip() else ""
    if not message or message.startswith("To enable traceback"):
        message = f"exit code {failure.exitcode}" + (f" ({failure.signal_name()})" if failure.exitcode < 0 else "")
    cls_name, _, text = message.partition(": ")
    cls = getattr(errors, cls_name, None)
    if isinstance(cls, type) and issubclass(cls, GptossError) and text:
        return cls(f"worker rank {rank}: {text}")
    return TrainingError(f"worker rank {rank} failed: {message}", hint="see the worker's output above")


__all__ = ["train", "launch_local", "preflight_recipe", "default_nproc", "oom_kills"]
