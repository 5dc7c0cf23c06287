"""Per-rank bodies of the overlap-schedule tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import torch

from gptoss_cli.model.config import preset
from gptoss_cli.parallel.state import ParallelState, init_parallel
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.data import DataLoaderState
from gptoss_cli.train.loop import forward_step
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
