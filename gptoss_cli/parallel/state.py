"""Process groups for pipeline x data parallel x context parallel x expert parallel, on torch DeviceMeshes.

Layout (Megatron's, docs/megatron-rules.md, "Token dispatcher and expert data parallel"): EP is
carved out of data parallel, so
dense parameters are replicated over every rank (their data-parallel group is the whole world)
and experts are split over the `ep` mesh dimension; the ranks holding the same experts form the
expert-data-parallel group of size world / EP. Ranks of one EP group are consecutive, so on a
multi-GPU node the all-to-all stays inside the node.

Context parallel (CP, docs/context-parallel.md) splits every sequence over `cp_size` consecutive
ranks; ranks of one CP group read the same microbatches, so the data-parallel size of the data is
world / CP. Dense parameters stay replicated over the whole world, so their gradients are reduced
over DP x CP; EP is carved out of the same world and may span the CP ranks (Megatron allows it).

Pipeline parallel (PP, docs/pipeline-parallel.md) is the outermost dimension, as in Megatron's
order (tp-cp-ep-dp-pp): the world is PP consecutive blocks of world / PP ranks, block p holding
pipeline stage p (and, with virtual stages, its later chunks). Everything above then applies inside
one block: the dense parameters of a stage are replicated over the block (`dp_group`), its experts
split over `ep` with `expert_dp_group` the block's ranks that hold the same experts, and CP groups
are consecutive ranks of the block. `pp_group` joins the ranks at the same place of every block
(they pass activations to each other); `world_group` is every rank (the step's token count and
totals, the global gradient norm). With PP = 1 the block is the world and nothing changes.

A single process without torch.distributed gets a `ParallelState` whose groups are None; every
collective helper in this package is a no-op then, so the same code trains on one CPU.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.expert_names import ep_slice

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, ReduceOp, Work
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class ParallelState:
    """Who this rank is in DP x EP and the process groups it talks to."""

    world_size: int = 1
    rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    expert_dp_size: int = 1
    expert_dp_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: DeviceMesh | None = None  # when distributed
    dp_group: ProcessGroup | None = None  # dense parameters: the whole world
    ep_group: ProcessGroup | None = None
    # The same ranks as ep_group on a communicator of their own: the MoE dispatcher's token-count
    # exchange, so that it never queues behind the other microbatch's token all-to-all in flight on
    # ep_group (NCCL runs each communicator on its own stream; model/dispatcher.py).
    ep_control_group: ProcessGroup | None = None
    expert_dp_group: ProcessGroup | None = None
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: ProcessGroup | None = None  # the ranks that hold slices of the same sequences (None: CP = 1)
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: ProcessGroup | None = None  # the ranks of the other pipeline stages at this rank's place (None: PP = 1)
    world_group: ProcessGroup | None = None  # every rank (None: one process)

    @property
    def global_group(self) -> ProcessGroup | None:
        """Every rank: what the step's normaliser, its totals and the gradient norm are summed over
        (the data-parallel group when the state was built without a world group: PP = 1)."""
        return self.world_group if self.world_group is not None else self.dp_group

    @property
    def stage_world_size(self) -> int:
        """Ranks per pipeline stage: world / PP."""
        return self.world_size // self.pp_size

    @property
    def dp_size(self) -> int:
        """The group dense gradients are reduced over: the ranks of this pipeline stage (DP x CP)."""
        return self.stage_world_size

    @property
    def dp_rank(self) -> int:
        return self.rank % self.stage_world_size

    @property
    def data_parallel_size(self) -> int:
        """How many different microbatch streams the world reads: world / (PP x CP)."""
        return self.stage_world_size // self.cp_size

    @property
    def data_parallel_rank(self) -> int:
        """Which stream this rank reads: the ranks of one CP group are consecutive and share it, and
        the ranks at the same place of every pipeline stage read the same one."""
        return self.dp_rank // self.cp_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def local_expert_range(self, num_experts: int) -> tuple[int, int]:
        """(expert_offset, num_local_experts) of this rank's contiguous block of global experts."""
        if num_experts % self.ep_size:
            raise ConfigError(
                f"num_local_experts={num_experts} is not divisible by expert_model_parallel_size={self.ep_size}",
                hint="choose an EP size that divides the number of experts",
            )
        held = ep_slice(num_experts, self.ep_size, self.ep_rank)
        return held.start, len(held)


def torchrun_env() -> dict[str, int] | None:
    """RANK/WORLD_SIZE/LOCAL_RANK when this process was started by torchrun or our launcher."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return None


def pick_device(device: str = "auto") -> torch.device:
    """The device this rank trains on: CUDA (local rank's GPU) when asked for or available, else CPU."""
    env = torchrun_env()
    local_rank = env["LOCAL_RANK"] if env else 0
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda but no CUDA device is visible", hint="use device=cpu")
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(_too_many_ranks(local_rank + 1, torch.cuda.device_count()), hint=_TOO_MANY_HINT)
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", torch.cuda.current_device())
    if device != "cpu":
        raise ConfigError(f"device={device!r} is not one of auto, cuda, cpu")
    return torch.device("cpu")


_TOO_MANY_HINT = ("start at most one rank per GPU (--nproc-per-node, torchrun's --nproc-per-node), make more "
                  "GPUs visible (CUDA_VISIBLE_DEVICES), or train on system.device=cpu")


def _too_many_ranks(ranks: int, gpus: int) -> str:
    return (f"{ranks} ranks on this node but {gpus} CUDA device(s) visible: each rank needs a GPU of its own "
            "(ranks sharing a GPU make NCCL fail later)")


def check_local_gpus(local_ranks: int, device: str = "auto") -> None:
    """Before any rank starts: refuse more local ranks than visible GPUs when they would train on
    CUDA (`device` cuda, or auto with a GPU visible). A ConfigError, exit 2; nothing to check on the CPU."""
    if device == "cpu" or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if local_ranks > gpus:
        raise ConfigError(_too_many_ranks(local_ranks, gpus), hint=_TOO_MANY_HINT)


def init_parallel(
    ep_size: int = 1, device: str | torch.device = "auto", backend: str = "auto", timeout_s: float = 600.0,
    join_timeout_s: float | None = None,
    cp_size: int = 1,
    pp_size: int = 1,
) -> ParallelState:
    """Join the process group (NCCL on CUDA, gloo on CPU) and build the (pp, expert_dp, ep) and (pp, dp, cp) meshes.

    `join_timeout_s`: end the process (one line, exit 1) when the other ranks have not joined by then;
    None = torch's rendezvous timeout (`timeout_s`). Ctrl-C and SIGTERM end the wait either way."""
    dev = device if isinstance(device, torch.device) else pick_device(device)
    env = torchrun_env()
    # A process group joined already (a test harness, a simulation) defines the world.
    world = dist.get_world_size() if dist.is_initialized() else env["WORLD_SIZE"] if env else 1
    if ep_size < 1 or world % ep_size:
        raise ConfigError(
            f"expert_model_parallel_size={ep_size} does not divide the world size {world}",
            hint="use a world size that is a multiple of the EP size",
        )
    if cp_size < 1 or world % cp_size:
        raise ConfigError(
            f"context_parallel_size={cp_size} does not divide the world size {world}",
            hint="use a world size that is a multiple of the CP size",
        )
    if pp_size < 1 or world % pp_size or (world // pp_size) % ep_size or (world // pp_size) % cp_size:
        raise ConfigError(
            f"pipeline_model_parallel_size={pp_size} with EP={ep_size} and CP={cp_size} does not fit the world "
            f"size {world}: every pipeline stage holds world / PP ranks, a multiple of EP and of CP",
            hint="use a world size that is a multiple of PP x EP and of PP x CP",
        )
    if world == 1:
        return ParallelState(ep_size=ep_size, device=dev) if ep_size == 1 else _single_rank_error(ep_size)
    if not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if dev.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
        if dev.type == "cuda":
            kwargs["device_id"] = dev
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        rank = env["RANK"] if env else "?"
        what = f"rank {rank} was waiting for the other ranks (world size {world}) to join at {where}"
        with interruptible_wait(what, join_timeout_s, "system.heartbeat_timeout_s"):
            dist.init_process_group(**kwargs)
    return state_from_world(ep_size, dev, cp_size, pp_size)


@contextlib.contextmanager
def interruptible_wait(what: str, deadline_s: float | None = None, deadline_name: str = "") -> Iterator[None]:
    """Around a call that blocks the main thread inside C++ (the rendezvous of init_process_group), where
    Python's signal handlers cannot run until it returns: a thread that sees Ctrl-C / SIGTERM arrive (through
    the signal wakeup fd, written by the C-level handler at once) or the deadline pass ends the process with
    one line, exit 130 / 143 / 1. Nothing is written before the rendezvous, so nothing is left half-written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    reader.settimeout(0.2)
    old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    done = threading.Event()

    def end(line: str, code: int) -> None:
        if not done.is_set():
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            os._exit(code)

    def watch() -> None:
        start = time.monotonic()
        while not done.is_set():
            try:
                received = reader.recv(64)
            except socket.timeout:
                received = b""
            except OSError:
                return
            if signal.SIGTERM in received:
                end(f"terminated: {what}; nothing was left half-written", 128 + signal.SIGTERM)
            if signal.SIGINT in received:
                end(f"interrupted: {what}; nothing was left half-written", 128 + signal.SIGINT)
            if deadline_s is not None and time.monotonic() - start > deadline_s:
                end(f"error: {what}: not all of them joined within {deadline_s:g} s ({deadline_name}); "
                    "ending this rank", 1)

    thread = threading.Thread(target=watch, name="gptoss-join-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(old_fd)
        thread.join(timeout=1)
        reader.close()
        writer.close()


def state_from_world(ep_size: int, device: torch.device, cp_size: int = 1, pp_size: int = 1) -> ParallelState:
    """The (expert_dp, ep) mesh, the (dp, cp) mesh when CP > 1, and their groups over the
    already-initialised default process group; with PP > 1 every mesh gets an outer `pp` dimension."""
    if pp_size > 1:
        return _pipeline_state(ep_size, device, cp_size, pp_size)
    from torch.distributed.device_mesh import init_device_mesh

    world, dev = dist.get_world_size(), device
    mesh_device = "cpu" if dev.type == "meta" else dev.type
    mesh = init_device_mesh(mesh_device, (world // ep_size, ep_size), mesh_dim_names=("expert_dp", "ep"))
    rank = dist.get_rank()
    # One control group per EP group, created by every rank in the same order (new_group is collective).
    ep_ranks = mesh.mesh.reshape(world // ep_size, ep_size).tolist()
    ep_control_group = dist.new_subgroups_by_enumeration(ep_ranks)[0] if ep_size > 1 else None
    cp_group, cp_rank = None, 0
    if cp_size > 1:
        cp_mesh = init_device_mesh(mesh_device, (world // cp_size, cp_size), mesh_dim_names=("dp", "cp"))
        cp_group, cp_rank = cp_mesh.get_group("cp"), cp_mesh["cp"].get_local_rank()
    return ParallelState(
        world_size=world,
        rank=rank,
        ep_size=ep_size,
        ep_rank=mesh["ep"].get_local_rank(),
        expert_dp_size=world // ep_size,
        expert_dp_rank=mesh["expert_dp"].get_local_rank(),
        device=dev,
        mesh=mesh,
        dp_group=dist.group.WORLD,
        ep_group=mesh.get_group("ep"),
        ep_control_group=ep_control_group,
        expert_dp_group=mesh.get_group("expert_dp"),
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_group=cp_group,
        world_group=dist.group.WORLD,
    )


def _pipeline_state(ep_size: int, device: torch.device, cp_size: int, pp_size: int) -> ParallelState:
    """PP outermost (Megatron's order): (pp, expert_dp, ep), (pp, dp) and (pp, dp, cp) meshes."""
    from torch.distributed.device_mesh import init_device_mesh

    world, dev = dist.get_world_size(), device
    stage = world // pp_size
    mesh_device = "cpu" if dev.type == "meta" else dev.type
    mesh = init_device_mesh(mesh_device, (pp_size, stage // ep_size, ep_size), mesh_dim_names=("pp", "expert_dp", "ep"))
    # the EP groups' control groups, as above (every rank creates all of them, in one order)
    ep_ranks = mesh.mesh.reshape(world // ep_size, ep_size).tolist()
    ep_control_group = dist.new_subgroups_by_enumeration(ep_ranks)[0] if ep_size > 1 else None
    dense = init_device_mesh(mesh_device, (pp_size, stage), mesh_dim_names=("pp", "dp"))
    cp_group, cp_rank = None, 0
    if cp_size > 1:
        cp_mesh = init_device_mesh(mesh_device, (pp_size, stage // cp_size, cp_size), mesh_dim_names=("pp", "dp", "cp"))
        cp_group, cp_rank = cp_mesh.get_group("cp"), cp_mesh["cp"].get_local_rank()
    return ParallelState(
        world_size=world, rank=dist.get_rank(), ep_size=ep_size, ep_rank=mesh["ep"].get_local_rank(),
        expert_dp_size=stage // ep_size, expert_dp_rank=mesh["expert_dp"].get_local_rank(), device=dev, mesh=mesh,
        dp_group=dense.get_group("dp"), ep_group=mesh.get_group("ep"), ep_control_group=ep_control_group,
        expert_dp_group=mesh.get_group("expert_dp"),
        cp_size=cp_size, cp_rank=cp_rank, cp_group=cp_group, pp_size=pp_size, pp_rank=mesh["pp"].get_local_rank(),
        pp_group=mesh.get_group("pp"), world_group=dist.group.WORLD,
    )


def _single_rank_error(ep_size: int) -> ParallelState:
    raise ConfigError(
        f"expert_model_parallel_size={ep_size} needs at least {ep_size} processes, got 1",
        hint=f"pass --nproc-per-node {ep_size} (or a multiple of it)",
    )


def destroy_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# --- collectives that are no-ops without a group ---------------------------------------------
def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, op: ReduceOp | None = None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group)
    return tensor


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


# all_gather_into_tensor / reduce_scatter_tensor were renamed *_single in torch 2.13.
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, async_op: bool = False
                   ) -> Work | None:
    """Sum `input` (group size x output.numel() elements) over the group; rank r keeps the r-th part
    in `output` (which may be that part of `input` itself)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, async_op: bool = False
               ) -> Work | None:
    """Concatenate every rank's `input` into `output` (which may hold this rank's `input` in place)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(group, src_group_rank), group=group)
    return tensor


def barrier(group: ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


__all__ = [
    "ParallelState", "init_parallel", "check_local_gpus", "interruptible_wait", "state_from_world", "destroy_parallel",
    "pick_device", "torchrun_env",
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "group_size", "group_rank",
]
