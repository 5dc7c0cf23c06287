"""optimizer.grad_reduce_in_fp32=false: gradient buffers in the params dtype (half the memory for bf16),
summed with bf16 rounding, stepped by AdamW in fp32 exactly as torch's AdamW steps those gradients."""

from __future__ import annotations

import torch

from gptoss_cli.model.config import preset
from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.parallel.grads import GradAccumulatingModel, GradBufferConfig
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.recipe import load_recipe
from gptoss_cli.recipe.estimate import memory as M
from gptoss_cli.train.optimizer import DistributedAdamW
from tests.train.jobs import optimizer_config

TINY = preset("tiny")
U_BF16 = 2.0**-8  # unit roundoff of bf16 (8 significand bits)


def _wrapped(fp32: bool) -> GradAccumulatingModel:
    torch.manual_seed(0)
    model = HybridModel(TINY, dtype=torch.bfloat16).train()
    return GradAccumulatingModel(model, ParallelState(), GradBufferConfig(grad_reduce_in_fp32=fp32))


def _accumulate(wrapped: GradAccumulatingModel, batches: list[torch.Tensor]) -> None:
    wrapped.zero_grad_buffer()
    for ids in batches:
        wrapped(ids).lm_loss_sum(ids).backward()


def test_bf16_gradient_buffers_sum_with_bf16_rounding_and_step_like_torch_adamw():
    batches = [torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    wide, narrow = _wrapped(True), _wrapped(False)
    for w in (wide, narrow):
        _accumulate(w, batches)
    assert {b.data.dtype for b in narrow.grad_buffers.buffers()} == {torch.bfloat16}
    assert {b.data.dtype for b in wide.grad_buffers.buffers()} == {torch.float32}
    # Per microbatch both add the same bf16 .grad; the fp32 sum of two is (nearly) exact, the bf16 sum
    # rounds once: at most U_BF16 x |sum| per element, plus a bf16 ulp of the smallest normal for zeros.
    for wb, nb in zip(wide.grad_buffers.buffers(), narrow.grad_buffers.buffers()):
        err = (nb.data.double() - wb.data.double()).abs()
        assert bool((err <= U_BF16 * wb.data.double().abs() + 1e-30).all())
        assert wb.data.abs().max() > 0
    # One AdamW step from the bf16 buffer equals torch's AdamW on the same gradients in fp32.
    cfg = optimizer_config(weight_decay=0.0, clip_grad=0.0)
    opt = DistributedAdamW(narrow, ParallelState(), cfg, lr=1e-3)
    params = [p for p in narrow.module.parameters()]
    ref = [p.detach().float().clone().requires_grad_(True) for p in params]
    for r, p in zip(ref, params):
        r.grad = p.main_grad.float().clone()
    torch_opt = torch.optim.AdamW(ref, lr=1e-3, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                  weight_decay=0.0)
    opt.step(1e-3)
    torch_opt.step()
    for r, p in zip(ref, params):
        assert torch.equal(p, r.detach().to(torch.bfloat16))


def test_the_estimate_halves_the_gradient_buffer():
    full = load_recipe("h100_bf16", ["optimizer.grad_reduce_in_fp32=true"])
    half = load_recipe("h100_bf16", ["optimizer.grad_reduce_in_fp32=false"])
    a = M.estimate_memory(full.config, full.arch, full.pattern, 64)
    b = M.estimate_memory(half.config, half.arch, half.pattern, 64)
    assert b.bytes_of("grads") * 2 == a.bytes_of("grads")
    assert a.total_bytes - b.total_bytes == a.bytes_of("grads") / 2
