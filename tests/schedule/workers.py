"""Per-rank bodies of the overlap-schedule tests (importable by spawned processes)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from gptoss_cli.model.config import preset
from gptoss_cli.parallel.state import ParallelState, init_parallel
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.data import DataLoaderState
from gptoss_cli.train.objective import forward_step
from gptoss_cli.train.provider import HybridModelProvider
from gptoss_cli.train.setup import setup_model_and_optimizer
from tests.train.dist_helpers import named_grads
from tests.train.jobs import optimizer_config, runtime_config
from tests.train.workers import RandomTokens

TINY = preset("tiny")
SEQ = 16


def build(state: ParallelState, *, overlap: bool, pattern: str, aux: float = 0.01, seed: int = 7):
    runtime = runtime_config(pattern=pattern, aux_loss_coeff=aux, ep_size=state.ep_size,
                             overlap_moe_expert_parallel_comm=overlap, delay_wgrad_compute=overlap)
    # The overlap run also reduces its gradients in several buckets started during the last
    # backward (overlap_grad_reduce); the plain run in one bucket after it.
    opt = optimizer_config(clip_grad=1.0, bucket_size=20_000 if overlap else None)
    return setup_model_and_optimizer(HybridModelProvider(runtime, seed=seed), state, opt, 3e-3,
                                     overlap_grad_reduce=overlap)


def equivalence_worker(rank: int, ep: int, steps: int, global_batch: int, mbs: int, pattern: str) -> dict[str, Any]:
    """The plain schedule and combined 1F1B (+ delayed wgrad) side by side on the same data and, at
    every step, the same weights: the plain run takes the optimizer step and its weights are copied
    into the overlap model before the next step (AdamW would otherwise turn rounding-level gradient
    differences into whole +-lr steps, see tests/tolerances.py). Per step: each one's microbatch
    losses and finalised gradients."""
    state = init_parallel(ep, "cpu")
    setups = {name: build(state, overlap=overlap, pattern=pattern) for name, overlap in (("plain", False),
                                                                                          ("overlap", True))}
    datas = {name: DataLoaderState(RandomTokens(TINY.vocab_size, SEQ, seed=5), global_batch_size=global_batch,
                                   micro_batch_size=mbs, dp_rank=state.dp_rank, dp_size=state.dp_size)
             for name in setups}
    runs: dict[str, Any] = {name: [] for name in setups}
    for _ in range(steps):
        for name, setup in setups.items():
            schedule = get_forward_backward_func(setup.config)
            setup.model.zero_grad_buffer()
            logs = schedule(forward_step_func=forward_step, data_iterator=datas[name].step_iterator(),
                            model=setup.model, num_microbatches=datas[name].num_microbatches)
            runs[name].append({"loss_sums": [float(l["loss_sum"]) for l in logs], "schedule": schedule.__name__,
                               "grads": named_grads(setup.model)})
        setups["plain"].optimizer.step(3e-3)
        copy_weights(setups["plain"].model, setups["overlap"].model)
    return runs


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """dst's parameters := src's (same architecture and expert slice)."""
    with torch.no_grad():
        dst_params = dict(dst.named_parameters())
        for name, p in src.named_parameters():
            dst_params[name].copy_(p)


def count_step_host_syncs(setup: Any, state: ParallelState, microbatches: int, mbs: int = 2) -> dict[str, int]:
    """Host-sync sites (tests/schedule/host_syncs.py) of one step's forward, backward and gradient
    finalisation through the setup's schedule, after one uncounted warm-up step. The expert bias
    paths run as on a GPU (their CPU-only per-expert branch reads the counts, which costs nothing
    there but would sync a device)."""
    from gptoss_cli.model import host_reads
    from tests.schedule.host_syncs import HostSyncCounter

    data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ, seed=5), global_batch_size=microbatches * mbs * state.dp_size,
                           micro_batch_size=mbs, dp_rank=state.dp_rank, dp_size=state.dp_size)
    schedule = get_forward_backward_func(setup.config)
    reads_free = host_reads.free
    host_reads.free = lambda device: False
    try:
        for counted in (False, True):
            setup.model.zero_grad_buffer()
            counter = HostSyncCounter()
            with counter if counted else contextlib.nullcontext():
                schedule(forward_step_func=forward_step, data_iterator=data.step_iterator(), model=setup.model,
                         num_microbatches=microbatches)
    finally:
        host_reads.free = reads_free
    return dict(counter.sites)


LINK_LATENCY_S = 0.05
LINK_WIRE_S = 0.05
SYNC_MICROBATCHES = 2


def link_timings(group: Any) -> dict[str, Any]:
    """Wall and process CPU time of all-to-alls under a simulated link (tests/support/simlink.py, injected as
    the communication object): latency only (synchronous, and asynchronous with the wait after it),
    bandwidth only, two queued asynchronous transfers, and no link."""
    import time

    import torch.distributed as dist

    from tests.support.simlink import LinkComm, LinkModel
    from gptoss_cli.model.dispatcher import all_to_all, start_all_to_all

    x = torch.randn(64, 32)  # 32 rows to the other rank: 4096 bytes
    splits = [32, 32]
    off_rank_bytes = 32 * 32 * 4
    gbps = off_rank_bytes * 8 / LINK_WIRE_S / 1e9  # the 4096 bytes take LINK_WIRE_S on the wire

    def timed(fn):
        dist.barrier()  # both ranks arrive together: gloo's own wait for a late peer is not measured
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - t0, time.process_time() - c0

    def two_async(comm):
        a = start_all_to_all(x, splits, splits, group, comm)
        b = start_all_to_all(x, splits, splits, group, comm)
        a.wait(), b.wait()

    out: dict[str, Any] = {}
    link = LinkModel(float("inf"), LINK_LATENCY_S * 1e6)
    comm = LinkComm(link)
    out["latency_sync"] = timed(lambda: all_to_all(x, splits, splits, group, comm))
    issued = time.perf_counter()
    handle = start_all_to_all(x, splits, splits, group, comm)
    out["async_issue_s"] = time.perf_counter() - issued
    _, cpu = timed(handle.wait)
    out["latency_async"] = (time.perf_counter() - issued, cpu)
    out["latency_link"] = (link.transfers, link.bytes_moved, link.modeled_s, link.blocked_s)
    wire, wire_two = LinkComm(LinkModel(gbps, 0.0)), LinkComm(LinkModel(gbps, 0.0))
    out["wire_sync"] = timed(lambda: all_to_all(x, splits, splits, group, wire))
    out["wire_two_async"] = timed(lambda: two_async(wire_two))
    # No communication object given: the dispatcher's default (torch.distributed). Whatever delays a
    # simulated link adds is a sleep (tests/support/simlink.wait_until), so count the sleeps instead of
    # timing the call, which a loaded host can stretch past any bound.
    sleeps: list[float] = []
    real_sleep = time.sleep
    time.sleep = lambda s: (sleeps.append(s), real_sleep(s))[1]
    try:
        all_to_all(x, splits, splits, group)
    finally:
        time.sleep = real_sleep
    out["no_link_sleeps"] = sleeps
    return out


def model_link_counts(setup: Any, state: ParallelState, microbatches: int, mbs: int = 2) -> dict[str, Any]:
    """What a link installed on a model (tests/support/simlink.py `use_link`) carries in one training step
    through the setup's schedule, and whether every dispatcher has its own communication object back."""
    from tests.support.simlink import LinkComm, LinkModel, token_dispatchers, use_link
    from gptoss_cli.model.dispatcher import DIST_COMM

    data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ, seed=5), global_batch_size=microbatches * mbs * state.dp_size,
                           micro_batch_size=mbs, dp_rank=state.dp_rank, dp_size=state.dp_size)
    schedule = get_forward_backward_func(setup.config)
    setup.model.zero_grad_buffer()
    with use_link(setup.model, LinkModel(float("inf"), 0.0)) as link:
        inside = [isinstance(d.comm, LinkComm) for d in token_dispatchers(setup.model)]
        schedule(forward_step_func=forward_step, data_iterator=data.step_iterator(), model=setup.model,
                 num_microbatches=microbatches)
    return {"counts": dict(link.counts), "inside": inside,
            "restored": [d.comm is DIST_COMM for d in token_dispatchers(setup.model)]}


def step_groups(setup: Any, state: ParallelState, microbatches: int, mbs: int = 2) -> dict[str, list[str]]:
    """Which process group each all-to-all of one step ran on, by kind: the token-count exchange
    ("control") and the token rows ("bulk"), as "ep_control", "ep" or "other"."""
    from tests.support.simlink import token_dispatchers
    from gptoss_cli.model.dispatcher import DistComm

    def name(group: Any) -> str:
        return "ep_control" if group is state.ep_control_group else "ep" if group is state.ep_group else "other"

    seen: dict[str, set[str]] = {"control": set(), "bulk": set()}

    class Recording(DistComm):
        def all_to_all(self, out, x, output_splits, input_splits, group, *, control=False):
            seen["control" if control else "bulk"].add(name(group))
            super().all_to_all(out, x, output_splits, input_splits, group, control=control)

        def start_all_to_all(self, out, x, output_splits, input_splits, group):
            seen["bulk"].add(name(group))
            return super().start_all_to_all(out, x, output_splits, input_splits, group)

    data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ, seed=5), global_batch_size=microbatches * mbs * state.dp_size,
                           micro_batch_size=mbs, dp_rank=state.dp_rank, dp_size=state.dp_size)
    dispatchers = token_dispatchers(setup.model)
    saved = [d.comm for d in dispatchers]
    for d in dispatchers:
        d.comm = Recording()
    try:
        setup.model.zero_grad_buffer()
        get_forward_backward_func(setup.config)(forward_step_func=forward_step, data_iterator=data.step_iterator(),
                                                model=setup.model, num_microbatches=microbatches)
    finally:
        for d, comm in zip(dispatchers, saved):
            d.comm = comm
    return {kind: sorted(names) for kind, names in seen.items()}


def comm_costs_worker(rank: int) -> dict[str, Any]:
    """One 2-process launch for the communication-cost tests: the host syncs of a training step at
    EP=2 (plain and overlap schedules, SYNC_MICROBATCHES microbatches, 3 MoE layers), the link model's
    timings, and what a link installed on the model carries in a step of each schedule."""
    state = init_parallel(2, "cpu")
    setups = {name: build(state, overlap=overlap, pattern="*E*E*E") for name, overlap in (("plain", False),
                                                                                          ("overlap", True))}
    syncs = {name: count_step_host_syncs(setup, state, microbatches=SYNC_MICROBATCHES) for name, setup in setups.items()}
    model_link = {name: model_link_counts(setup, state, microbatches=SYNC_MICROBATCHES) for name, setup in setups.items()}
    groups = {name: step_groups(setup, state, microbatches=SYNC_MICROBATCHES) for name, setup in setups.items()}
    return {"syncs": syncs, "link": link_timings(state.ep_group), "model_link": model_link, "groups": groups}
