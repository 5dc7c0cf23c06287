"""Per-rank bodies of the overlap-schedule tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import torch

from gptoss_cli.model.config import preset
from gptoss_cli.parallel.state import ParallelState, init_parallel
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.data import DataLoaderState
from gptoss_cli.train.loop import forward_step
from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig
from gptoss_cli.train.setup import OptimizerSettings, setup_model_and_optimizer
from tests.train.dist_helpers import named_grads
from tests.train.workers import RandomTokens

TINY = preset("tiny")
SEQ = 16


def build(state: ParallelState, *, overlap: bool, pattern: str, aux: float = 0.01, seed: int = 7):
    runtime = ModelRuntimeConfig(arch=TINY, hybrid_layer_pattern=pattern, params_dtype="fp32", aux_loss_coeff=aux,
                                 expert_model_parallel_size=state.ep_size, overlap_moe_expert_parallel_comm=overlap,
                                 delay_wgrad_compute=overlap)
    return setup_model_and_optimizer(HybridModelProvider(runtime, seed=seed), state,
                                     OptimizerSettings(lr=3e-3, clip_grad=1.0))


def equivalence_worker(rank: int, ep: int, steps: int, global_batch: int, mbs: int, pattern: str) -> dict[str, Any]:
    """The plain schedule and combined 1F1B (+ delayed wgrad) side by side on the same data and weights:
    per step, each one's loss, tokens and finalised gradients; both take the same optimizer steps."""
    state = init_parallel(ep, "cpu")
    runs: dict[str, Any] = {}
    for name, overlap in (("plain", False), ("overlap", True)):
        setup = build(state, overlap=overlap, pattern=pattern)
        data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ, seed=5), global_batch_size=global_batch,
                               micro_batch_size=mbs, dp_rank=state.dp_rank, dp_size=state.dp_size)
        schedule = get_forward_backward_func(setup.config)
        per_step = []
        for _ in range(steps):
            setup.model.zero_grad_buffer()
            logs = schedule(forward_step_func=forward_step, data_iterator=data.step_iterator(), model=setup.model,
                            num_microbatches=data.num_microbatches)
            per_step.append({"loss_sums": [float(l["loss_sum"]) for l in logs], "schedule": schedule.__name__,
                             "grads": named_grads(setup.model)})
            setup.optimizer.step(3e-3)
        runs[name] = per_step
    return runs


def assert_grads_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    """Every tensor within `rel` of its own largest magnitude (fp32 sums in another order differ by
    rounding on the tensor's scale, not on each element's)."""
    assert set(actual) == set(expected)
    for name, want in expected.items():
        err = (actual[name] - want).abs().max().item()
        scale = want.abs().max().item()
        assert err <= rel * scale + 1e-12, f"{name}: max |diff| {err:.3g} vs scale {scale:.3g}"
