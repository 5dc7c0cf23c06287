"""Per-rank body of the LoRA expert-parallel test (importable by spawned processes)."""

from __future__ import annotations

import zlib
from typing import Any

import torch

from gptoss_cli.model.expert_names import checkpoint_slots
from gptoss_cli.model.lora import adapter_modules, adapter_tensors, is_adapter_name
from gptoss_cli.parallel.grads import unwrap_model
from gptoss_cli.parallel.state import ParallelState, init_parallel
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.data import DataLoaderState
from gptoss_cli.train.objective import forward_step
from gptoss_cli.train.provider import HybridModelProvider
from gptoss_cli.train.setup import setup_model_and_optimizer
from tests.train.dist_helpers import reduced_main_grads
from tests.train.jobs import optimizer_config, runtime_config
from tests.train.workers import SEQ, TINY, RandomTokens

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def randomize_b_(model: torch.nn.Module, seed: int = 3) -> None:
    """B from a generator seeded by its checkpoint name (a fresh B is zero, and A's gradient with it)."""
    with torch.no_grad():
        for name, dest in checkpoint_slots(model):
            if dest is not None and is_adapter_name(name) and ".linear_out." in name:
                g = torch.Generator().manual_seed(seed * 1000 + zlib.crc32(name.encode()))
                dest.copy_(torch.randn(dest.shape, generator=g) * 0.05)


def adapter_grads(wrapped: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Finalised (data-parallel reduced) gradients of every adapter this rank holds, per checkpoint name."""
    grad_of = reduced_main_grads(list(wrapped.grad_buffers.buffers()))
    out = {}
    for layer, adapter in adapter_modules(unwrap_model(wrapped)):
        for part in ("linear_in", "linear_out"):
            p = getattr(adapter, part).weight
            g = grad_of[id(p)]
            stem = f"{layer}.adapter.{part}.weight"
            if hasattr(getattr(adapter, part), "global_ids"):
                for local, e in enumerate(getattr(adapter, part).global_ids()):
                    out[f"{stem}{e}"] = g[local].clone()
            else:
                out[stem] = g.clone()
    return out


def lora_grads(state: ParallelState, base_experts: str = "bf16") -> dict[str, Any]:
    """One global batch of 4 through the real schedule on a LoRA model; adapter grads and what is trainable.

    With `base_experts="mxfp4"` (frozen experts in MXFP4) the run then takes two optimizer steps and says
    whether the base's buffers (blocks, scales) and frozen parameters kept every bit."""
    cfg = runtime_config(aux_loss_coeff=0.01, ep_size=state.ep_size, lora_rank=4, lora_alpha=8.0, lora_targets=TARGETS,
                         lora_base_experts=base_experts)
    setup = setup_model_and_optimizer(HybridModelProvider(cfg, seed=7), state,
                                      optimizer_config(use_distributed_optimizer=True), 1e-3)
    inner = unwrap_model(setup.model)
    randomize_b_(inner)
    frozen = {n: t.clone() for n, t in [*inner.named_buffers(), *inner.named_parameters()] if ".adapter." not in n}
    data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ), global_batch_size=4, micro_batch_size=2,
                           dp_rank=state.dp_rank, dp_size=state.dp_size)
    logs = get_forward_backward_func(setup.config)(forward_step_func=forward_step, data_iterator=data.step_iterator(),
                                                   model=setup.model, num_microbatches=data.num_microbatches)
    buffered = sorted(n for buf in setup.model.grad_buffers.buffers() for n in buf.names)
    out = {"grads": adapter_grads(setup.model), "loss_sum": float(sum(l["lm_loss_sum"] for l in logs)),
           "trainable": sorted(n for n, p in inner.named_parameters() if p.requires_grad),
           "grad_buffer_elements": sum(b.data.numel() for b in setup.model.grad_buffers.buffers()),
           "buffered": buffered}
    if base_experts == "mxfp4":
        before = adapter_tensors(inner)
        before = {n: t.clone() for n, t in before.items()}
        setup.optimizer.step(1e-2)
        setup.model.zero_grad_buffer()
        get_forward_backward_func(setup.config)(forward_step_func=forward_step, data_iterator=data.step_iterator(),
                                                model=setup.model, num_microbatches=data.num_microbatches)
        setup.optimizer.step(1e-2)
        now = dict([*inner.named_buffers(), *inner.named_parameters()])
        out["packed"] = sorted(n for n in frozen if n.endswith((".blocks", ".scales")))
        out["base_changed"] = sorted(n for n, t in frozen.items() if not torch.equal(now[n], t))
        out["adapters_moved"] = all(not torch.equal(t, before[n]) for n, t in adapter_tensors(inner).items())
    return out


def lora_ep_worker(rank: int, ep: int, base_experts: str = "bf16") -> dict[str, Any]:
    return lora_grads(init_parallel(ep, "cpu"), base_experts)


def lora_overlap_worker(rank: int, ep: int, base_experts: str = "bf16", qat: str = "none") -> dict[str, Any]:
    """One global batch of 12 (3 microbatches per rank) through the plain schedule and through combined
    1F1B with delayed wgrad and overlap_grad_reduce, on the same LoRA model (same base, same adapters):
    the adapter gradients of each (`base_experts`: lora.base_experts, `qat`: precision.qat of both)."""
    state = init_parallel(ep, "cpu")
    out = {}
    for name, overlap in (("plain", False), ("overlap", True)):
        cfg = runtime_config(aux_loss_coeff=0.01, ep_size=state.ep_size, lora_rank=4, lora_alpha=8.0,
                             lora_targets=TARGETS, overlap_moe_expert_parallel_comm=overlap,
                             delay_wgrad_compute=overlap, lora_base_experts=base_experts, qat=qat)
        setup = setup_model_and_optimizer(HybridModelProvider(cfg, seed=7), state,
                                          optimizer_config(bucket_size=2_000 if overlap else None), 1e-3,
                                          overlap_grad_reduce=overlap)
        randomize_b_(unwrap_model(setup.model))
        data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ, seed=5), global_batch_size=12, micro_batch_size=2,
                               dp_rank=state.dp_rank, dp_size=state.dp_size)
        schedule = get_forward_backward_func(setup.config)
        schedule(forward_step_func=forward_step, data_iterator=data.step_iterator(), model=setup.model,
                 num_microbatches=data.num_microbatches)
        out[name] = {"grads": adapter_grads(setup.model), "schedule": schedule.__name__}
    return out
