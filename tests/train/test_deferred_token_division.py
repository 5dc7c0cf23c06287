"""The token division done by the optimizer's fused step instead of a pass of finalize's own.

With DistributedAdamW over fp32 buffers, finalize_model_grads leaves the reduced gradients as sums
and records the global token count; the optimizer divides the norm's row norms by it and hands it
to the fused kernel, which divides each gradient as it reads it and writes it back. What a reader
sees must not change: the gradient norm the step returns, main_grad after the step (the per-token
mean, clipped) and the weights after it. The reference is torch alone: autograd of the mean token
loss on an unwrapped copy of the model, torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW.
AdamW's update barely depends on the gradient's scale, so the norm and main_grad after the step
are what show a division that was skipped or done twice.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gptoss_cli.parallel.grads import unwrap_model
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.data import DataLoaderState
from gptoss_cli.train.objective import forward_step
from gptoss_cli.train.provider import HybridModelProvider
from gptoss_cli.train.setup import setup_model_and_optimizer
from tests.tolerances import reassociation_rel
from tests.train.jobs import optimizer_config, runtime_config
from tests.train.workers import SEQ, TINY, RandomTokens

GLOBAL, MBS, LR = 4, 2, 1e-3
# same weights and tokens, two orders of fp32 sums over the batch's tokens through the layers
GRAD_REL = reassociation_rel(GLOBAL * SEQ, 2 * TINY.num_hidden_layers + 1)


def _reference(provider, state, clip: float):
    """Mean-token-loss gradients of a plain copy, clipped by torch, and torch AdamW's weights after one step."""
    plain = provider.provide(state)
    batch = torch.stack([RandomTokens(TINY.vocab_size, SEQ).sample(i) for i in range(GLOBAL)])
    logits = plain(batch[:, :-1]).logits.float()
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(list(plain.parameters()), clip, foreach=False))
    cfg = optimizer_config(weight_decay=0.0, clip_grad=clip)
    torch.optim.AdamW(plain.parameters(), lr=LR, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                      weight_decay=0.0, foreach=False).step()
    return norm, {n: p.grad for n, p in plain.named_parameters()}, dict(plain.named_parameters())


@pytest.mark.parametrize("clip", [1e9, 0.05], ids=["unclipped", "clipped"])
def test_the_step_divides_by_the_tokens_as_finalize_did(clip):
    state = ParallelState()
    provider = HybridModelProvider(runtime_config(aux_loss_coeff=0.0), seed=7)
    setup = setup_model_and_optimizer(provider, state, optimizer_config(weight_decay=0.0, clip_grad=clip), LR)
    buffers = list(setup.model.grad_buffers.buffers())
    assert all(buf.defer_division for buf in buffers)
    data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ), global_batch_size=GLOBAL, micro_batch_size=MBS,
                           dp_rank=0, dp_size=1)
    get_forward_backward_func(setup.config)(forward_step_func=forward_step, data_iterator=data.step_iterator(),
                                            model=setup.model, num_microbatches=data.num_microbatches)
    assert all(float(buf.pending_divisor) == GLOBAL * SEQ for buf in buffers)  # left to the optimizer
    norm = setup.optimizer.step(LR)
    assert all(buf.pending_divisor is None for buf in buffers)

    ref_norm, ref_grads, ref_weights = _reference(provider, state, clip)
    assert (ref_norm > clip) == (clip < 1)  # the clipped case clips
    assert norm == pytest.approx(ref_norm, rel=GRAD_REL)
    ours = dict(unwrap_model(setup.model).named_parameters())
    for name, want in ref_grads.items():
        # main_grad after the step: the per-token mean gradient, clipped, as the kernel wrote it back
        err = (ours[name].main_grad.double() - want.double()).abs().max().item()
        assert err <= GRAD_REL * want.double().abs().max().item(), f"main_grad of {name} after the step: {err:.3g}"
        # AdamW moves each weight by about lr: the weights agree far inside one step
        assert (ours[name].detach() - ref_weights[name].detach()).abs().max().item() <= 0.01 * LR, name


def test_finalize_divides_at_once_without_an_optimizer_taking_it_over():
    from gptoss_cli.parallel.grads import GradAccumulatingModel, finalize_model_grads

    model = GradAccumulatingModel(torch.nn.Linear(3, 2), ParallelState())
    model(torch.ones(1, 3)).sum().backward()
    finalize_model_grads([model], torch.tensor(4), parallel_state=ParallelState())
    assert all(buf.pending_divisor is None for buf in model.grad_buffers.buffers())
    assert torch.equal(model.module.weight.main_grad, torch.full((2, 3), 0.25))
