"""Run a function on N gloo processes with a free port and a hard timeout (no hanging tests)."""

from __future__ import annotations

import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(int(os.environ.get("GPTOSS_TEST_THREADS", "1")))  # see tests/conftest.py
    out = Path(out_dir)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60))
        result = fn(rank, *args)
        torch.save(result, out / f"rank{rank}.pt")
        dist.barrier()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    # The barrier passed, so every rank has saved its result; only teardown follows this marker.
    (out / f"rank{rank}.done").touch()
    dist.destroy_process_group()


def _teardown_only(exc: BaseException, out_dir: Path, world: int) -> bool:
    """Whether a failed run failed only in process-group teardown, after every rank's result was saved.

    gloo may abort in `destroy_process_group` once a peer has gone; that is no failure of what a
    test checks. It is proven, not guessed: the failed rank wrote its `.done` marker, which
    `_entry` writes only after the post-result barrier (for a timeout: every rank did). A worker
    that raised or died anywhere before that (even after saving a result) is a failure.
    """
    if not all((out_dir / f"rank{r}.pt").is_file() for r in range(world)):
        return False
    if isinstance(exc, TimeoutError):
        failed = range(world)  # which rank hangs is unknown: all must be past the barrier
    elif isinstance(exc, (mp.ProcessRaisedException, mp.ProcessExitedException)):
        failed = [exc.error_index]
    else:
        return False
    return all((out_dir / f"rank{r}.done").is_file() for r in failed)


def run_distributed(fn: Callable[..., Any], world: int, out_dir: Path, *args: Any, timeout: float = 120.0,
                    preload: tuple[str, ...] | None = None) -> list[Any]:
    """fn(rank, *args) on `world` processes; returns each rank's return value (torch.save-able).

    Any worker that raises or exits non-zero fails the call (AssertionError with its traceback),
    unless that provably happened in teardown after every result was saved (`_teardown_only`).

    `preload`: start the workers from a forkserver that imported these modules (torch and the
    worker's) once, instead of spawning each from scratch: on 2 cores, 8 spawned workers spend
    about 20 s importing torch, forked ones about 2 s in all.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in (*out_dir.glob("rank*.pt"), *out_dir.glob("rank*.err"), *out_dir.glob("rank*.done")):
        stale.unlink()  # a reused folder must not vouch for this run
    if preload is not None:
        import multiprocessing

        multiprocessing.set_forkserver_preload(["torch", *preload])  # only until the server has started
    ctx = mp.start_processes(_entry, args=(fn, world, free_port(), str(out_dir), args), nprocs=world,
                             join=False, start_method="spawn" if preload is None else "forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed test did not finish in {timeout}s")
    except Exception as exc:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        errs = [p.read_text() for p in sorted(out_dir.glob("rank*.err"))]
        if errs or not _teardown_only(exc, out_dir, world):
            raise AssertionError(f"worker failed ({exc}):\n" + "\n".join(errs)) from None
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def reduced_main_grads(buffers) -> dict[int, torch.Tensor]:
    """id(param) -> its finalised main_grad, whole on every rank (a collective: call it on every rank).

    With the distributed optimizer a rank holds the reduced gradient only in its own shard of each
    bucket; the shards are all-gathered here, test-side, so tests compare whole tensors. A token
    division finalize left to the optimizer (`pending_divisor`) is applied to the copy, so the
    optimizer's step still does it."""
    from gptoss_cli.parallel.state import all_gather

    out: dict[int, torch.Tensor] = {}
    for buf in buffers:
        full = buf.data.detach().clone()
        if buf.sharded:
            for b in buf.buckets:
                all_gather(full[b.start : b.end], b.grad_shard.detach().clone(), buf.group)
        if buf.pending_divisor is not None:
            full /= buf.pending_divisor
        for p, (lo, hi) in zip(buf.params, buf.offsets):
            out[id(p)] = full[lo:hi].view(p.shape)
    return out


def named_grads(model: torch.nn.Module, buffers=None) -> dict[str, torch.Tensor]:
    """Finalised main_grad of every checkpoint tensor (experts split per global id).

    `model`: the training wrapper (its gradient buffers are used), or the unwrapped model with
    `buffers` given. Collective when the gradients are sharded: call it on every rank."""
    from gptoss_cli.parallel.grads import unwrap_model

    if buffers is None:
        buffers = list(model.grad_buffers.buffers())
    grad_of = reduced_main_grads(buffers)
    inner = unwrap_model(model)
    grads: dict[str, torch.Tensor] = {}
    params = dict(inner.named_parameters())
    for name, dest in inner.named_checkpoint_slots():
        # dest is a parameter or a row of a stacked expert parameter; find its main_grad by storage.
        for pname, p in params.items():
            if dest is p:
                grads[name] = grad_of[id(p)].clone()
                break
        else:
            owner, _, leaf = name.rpartition(".")
            base = leaf.rstrip("0123456789")
            e = int(leaf[len(base):])
            p = params[f"{owner}.{base}"]
            local = e - inner.get_submodule(owner).expert_offset
            grads[name] = grad_of[id(p)][local].clone()
    return grads


def once_per_session(tmp_path_factory: Any, name: str, compute: Callable[[Path], Any]) -> Any:
    """compute(folder) once per test session, shared by pytest-xdist workers.

    Module fixtures run once per xdist worker that gets one of the module's tests; the multi-process
    runs behind them are the expensive part, so the first worker computes under a file lock and
    saves the result, the others load it.
    """
    import fcntl

    base = tmp_path_factory.getbasetemp()
    root = base.parent if base.name.startswith("popen-gw") else base  # shared by the xdist workers
    folder = root / f"shared-{name}"
    result = root / f"shared-{name}.pt"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(compute(folder), result)
    return torch.load(result, weights_only=False)
