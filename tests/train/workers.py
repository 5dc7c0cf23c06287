"""Per-rank bodies of the multi-process training tests (importable by spawned processes)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoss_cli.model.config import preset
from gptoss_cli.parallel.grads import unwrap_model
from gptoss_cli.parallel.state import ParallelState, init_parallel
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.data import DataLoaderState
from gptoss_cli.train.objective import forward_step
from gptoss_cli.train.provider import HybridModelProvider
from gptoss_cli.train.setup import setup_model_and_optimizer
from tests.train.dist_helpers import named_grads
from tests.train.jobs import optimizer_config, runtime_config, train_job

TINY = preset("tiny")
SEQ = 16


class RandomTokens:
    """Uniform random token windows, seeded per sample index (same for any layout)."""

    def __init__(self, vocab: int, seq: int, seed: int = 0):
        self.vocab, self.seq, self.seed = vocab, seq, seed

    def sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 7919 + index)
        return torch.randint(0, self.vocab, (self.seq + 1,), generator=g)


def build(state: ParallelState, *, aux: float = 0.01, lr: float = 1e-3, distributed_opt: bool = True, seed: int = 7,
          **changes: Any):
    """`changes`: further runtime settings (tests/train/jobs.py's keywords, e.g. qat="mxfp4")."""
    provider = HybridModelProvider(runtime_config(aux_loss_coeff=aux, ep_size=state.ep_size, **changes), seed=seed)
    return setup_model_and_optimizer(
        provider, state, optimizer_config(clip_grad=1.0, use_distributed_optimizer=distributed_opt), lr
    )


def one_step_grads(state: ParallelState, global_batch: int = 4, mbs: int = 2, **changes: Any) -> dict[str, Any]:
    """Forward+backward of one global batch through the real schedule; loss and finalised grads."""
    setup = build(state, **changes)
    data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ), global_batch_size=global_batch, micro_batch_size=mbs,
                           dp_rank=state.dp_rank, dp_size=state.dp_size)
    schedule = get_forward_backward_func(setup.config)
    logs = schedule(forward_step_func=forward_step, data_iterator=data.step_iterator(), model=setup.model,
                    num_microbatches=data.num_microbatches)
    return {
        "loss_sum": float(sum(l["lm_loss_sum"] for l in logs)),
        "tokens": float(sum(l["num_tokens"] for l in logs)),
        "grads": named_grads(setup.model),
        "grad_norm": setup.optimizer.grad_norm(),
    }


def dispatcher_round_trip(state: ParallelState, route_to: tuple[int, ...]) -> dict[str, Any]:
    """All-to-all dispatch -> 'expert e multiplies by e+1' -> combine, forward and backward, with every
    token routed to the experts in `route_to` (so some ranks may receive no rows at all)."""
    from gptoss_cli.model.dispatcher import AllToAllTokenDispatcher

    g = torch.Generator().manual_seed(100 + state.rank)
    T, H, k = 5 + state.rank, 8, 2
    hidden = torch.randn(T, H, generator=g).requires_grad_()
    indices = torch.tensor([[route_to[(t + j) % len(route_to)] for j in range(k)] for t in range(T)])
    probs = torch.softmax(torch.randn(T, k, generator=g), -1)
    d = AllToAllTokenDispatcher(4, state.ep_size, state.ep_rank, state.ep_group)
    expert_input, counts, ctx = d.dispatch(hidden, probs, indices)
    scale = torch.repeat_interleave(torch.arange(d.expert_offset, d.expert_offset + d.num_local_experts) + 1.0, counts)
    out = d.combine(expert_input * scale[:, None], ctx)
    out.sum().backward()
    expected = (probs * (indices + 1)).sum(-1, keepdim=True)
    return {"rows": int(counts.sum()), "out_ok": bool(torch.allclose(out, hidden.detach() * expected, atol=1e-6)),
            "grad_ok": bool(torch.allclose(hidden.grad, expected.expand(T, H), atol=1e-6))}


def ep_grads_worker(rank: int, ep: int) -> dict[str, Any]:
    state = init_parallel(ep, "cpu")
    out = one_step_grads(state)
    out["dispatch_all"] = dispatcher_round_trip(state, (0, 1, 2, 3))
    out["dispatch_rank0_only"] = dispatcher_round_trip(state, (0, 1))  # rank 1's experts get nothing
    return out


def grads_per_step(state: ParallelState, global_batch: int, mbs: int, *, steps: int = 0,
                   weights_per_step: list[dict[str, torch.Tensor]] | None = None) -> list[dict[str, Any]]:
    """Loss and finalised gradients of consecutive global batches of random tokens.

    Without `weights_per_step` this is the reference run: `steps` steps, each followed by the
    optimizer step; the weights each step started from are returned too. With it, every step
    starts from the given weights (the reference's), so a candidate layout is compared with the
    reference from the same weights at every step, never after AdamW steps of its own (see
    tests/tolerances.py)."""
    setup = build(state, lr=3e-3)
    data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ, seed=3), global_batch_size=global_batch,
                           micro_batch_size=mbs, dp_rank=state.dp_rank, dp_size=state.dp_size)
    schedule = get_forward_backward_func(setup.config)
    inner = unwrap_model(setup.model)
    out = []
    for step in range(len(weights_per_step) if weights_per_step is not None else steps):
        with torch.no_grad():
            if weights_per_step is not None:
                for name, p in inner.named_parameters():
                    p.copy_(weights_per_step[step][name])
            weights = {name: p.detach().clone() for name, p in inner.named_parameters()}
        setup.model.zero_grad_buffer()
        logs = schedule(forward_step_func=forward_step, data_iterator=data.step_iterator(), model=setup.model,
                        num_microbatches=data.num_microbatches)
        out.append({"weights": weights, "grads": named_grads(setup.model),
                    "loss_sum": float(sum(l["lm_loss_sum"] for l in logs)),
                    "tokens": float(sum(l["num_tokens"] for l in logs))})
        if weights_per_step is None:
            setup.optimizer.step(3e-3)
    return out


def dp_grads_worker(rank: int, weights_per_step: list[dict[str, torch.Tensor]], global_batch: int,
                    mbs: int) -> list[dict[str, Any]]:
    steps = grads_per_step(init_parallel(1, "cpu"), global_batch, mbs, weights_per_step=weights_per_step)
    for s in steps:
        del s["weights"]  # the caller has them
    return steps


# --- callbacks on the runtime config ---------------------------------------------------------
@dataclass
class ToyConfig:
    finalize_model_grads_func: Any = None
    grad_scale_func: Any = None
    no_sync_func: Any = None
    grad_sync_func: Any = None
    param_sync_func: Any = None
    overlap_moe_expert_parallel_comm: bool = False
    extra: dict = field(default_factory=dict)


class ToyModel(nn.Module):
    """512 zero-initialised parameters in 8 tensors; loss = sign * sum(params)."""

    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = config
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(8, 8)) for _ in range(8))

    def forward(self, sign: float) -> torch.Tensor:
        return sign * sum(w.sum() for w in self.weights)


class CopyingProvider:
    """Like a canonical provider: the model gets a DEEP COPY of the provider's config."""

    def __init__(self) -> None:
        self.config = ToyConfig()

    def provide(self, state: ParallelState) -> nn.Module:
        return ToyModel(copy.deepcopy(self.config))


def callbacks_worker(rank: int, microbatches: int) -> dict[str, Any]:
    """The correct setup, then the same with the callbacks moved to the provider's config."""
    return {"ok": _callbacks_run(rank, microbatches), "on_provider": _callbacks_run(rank, 1, install_on_provider=True)}


def _callbacks_run(rank: int, microbatches: int, install_on_provider: bool = False) -> dict[str, Any]:
    """DP=2 through the real setup: +1 on rank 0, -3 on rank 1; one step; spy on the finaliser."""
    from gptoss_cli.parallel import grads as grads_module

    state = init_parallel(1, "cpu")
    calls: list[dict[str, Any]] = []
    real = grads_module.finalize_model_grads

    def spy(model_chunks, num_tokens=None, *, parallel_state):
        calls.append({"models": [id(m) for m in model_chunks], "num_tokens": float(num_tokens),
                      "dp_group_size": torch.distributed.get_world_size(parallel_state.dp_group),
                      "expert_dp_group_size": torch.distributed.get_world_size(parallel_state.expert_dp_group)})
        return real(model_chunks, num_tokens, parallel_state=parallel_state)

    grads_module.finalize_model_grads = spy
    try:
        provider = CopyingProvider()
        setup = setup_model_and_optimizer(provider, state, optimizer_config(clip_grad=0.0, use_distributed_optimizer=True),
                                          0.1)
        if install_on_provider:  # the binding bug of docs/upstream-failures.md, as a negative control
            provider.config.finalize_model_grads_func = setup.config.finalize_model_grads_func
            setup.config.finalize_model_grads_func = None
        sign = 1.0 if rank == 0 else -3.0

        def step_fn(it, model):
            next(it)
            return model(sign), lambda loss: (loss, torch.tensor(1.0), {})

        schedule = get_forward_backward_func(setup.config)
        setup.model.zero_grad_buffer()
        try:
            schedule(forward_step_func=step_fn, data_iterator=iter(range(microbatches)), model=setup.model,
                     num_microbatches=microbatches)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"error": f"{type(exc).__name__}: {exc}"}
        train_calls = len(calls)
        setup.optimizer.step(0.1)
        schedule(forward_step_func=step_fn, data_iterator=iter(range(microbatches)), model=setup.model,
                 num_microbatches=microbatches, forward_only=True)
        inner = unwrap_model(setup.model)
        owned = setup.optimizer.owned()
        return {
            "train_calls": train_calls, "calls_after_eval": len(calls), "calls": calls,
            "model_id": id(setup.model), "params": torch.cat([w.detach().flatten() for w in inner.weights]),
            "config_is_model_config": setup.config is inner.config,
            "provider_finalizer": provider.config.finalize_model_grads_func is not None, "owned": owned,
        }
    finally:
        grads_module.finalize_model_grads = real


# --- checkpoints across layouts --------------------------------------------------------------
def tiny_plan(run_dir: str, **changes: Any):
    base = dict(seq_length=16, micro_batch_size=2, global_batch_size=4, train_iters=3, lr=3e-3, min_lr=3e-4,
                warmup_iters=1, device="cpu", aux_loss_coeff=0.01, clip_grad=1.0, weight_decay=0.01)
    return train_job(run_dir, name="ckpt", **{**base, **changes})


def run_plan_worker(rank: int, plan: Any) -> dict[str, Any]:
    """run_worker on an already-initialised group; the result and this rank's model tensors."""
    from gptoss_cli.run.worker import run_worker

    result = run_worker(plan)
    return {"losses": result.losses, "result": result}


def ep2_checkpoint_run(work: Path) -> tuple[Path, list[dict[str, Any]]]:
    """3 steps of the tiny model at EP=2 on 2 processes, checkpoints at steps 2 and 3 in work/ckpt.
    Shared (tests/train/dist_helpers.py: once_per_session, name "ep2_checkpoint") by the resume and
    the conversion tests."""
    from tests.train.dist_helpers import run_distributed

    plan = tiny_plan(str(work / "run"), ep_size=2, train_iters=3, save_interval=2, checkpoint_dir=str(work / "ckpt"))
    return work, run_distributed(run_plan_worker, 2, work / "out", plan)


def torchrun_style_worker(rank: int, overrides: list[str]) -> dict[str, Any]:
    """`gptoss train`'s library entry inside an already-started process (RANK/WORLD_SIZE set)."""
    from gptoss_cli.recipe.load import load_recipe
    from gptoss_cli.run import launch

    def no_launch(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("train() started workers from inside a torchrun-started process")

    launch.launch_local = no_launch
    result = launch.train(load_recipe("tiny_cpu_ep2", overrides))
    return {"world_size": result.world_size, "losses": result.losses}
