"""moe.freeze_router: one real training step (schedule, gradient buffers, AdamW with weight decay)
leaves every router weight and bias bit-identical and moves the rest of the model."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.parallel.grads import unwrap_model
from gptoss_cli.parallel.state import destroy_parallel, init_parallel
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.data import DataLoaderState
from gptoss_cli.train.objective import forward_step
from gptoss_cli.train.provider import HybridModelProvider
from gptoss_cli.train.setup import setup_model_and_optimizer
from tests.train.jobs import optimizer_config, runtime_config
from tests.train.workers import SEQ, TINY, RandomTokens


def _one_step(freeze: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    state = init_parallel(1, "cpu", "auto")
    try:
        cfg = runtime_config(aux_loss_coeff=0.01, ep_size=1)
        cfg.z_loss_coeff, cfg.freeze_router = 1e-3, freeze
        # weight decay on: a frozen parameter that reached the optimizer would still shrink
        setup = setup_model_and_optimizer(HybridModelProvider(cfg, seed=7), state,
                                          optimizer_config(weight_decay=0.1, clip_grad=1.0), 1e-2)
        model = unwrap_model(setup.model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ), global_batch_size=4, micro_batch_size=2,
                               dp_rank=0, dp_size=1)
        setup.model.zero_grad_buffer()
        get_forward_backward_func(setup.config)(forward_step_func=forward_step, data_iterator=data.step_iterator(),
                                                model=setup.model, num_microbatches=data.num_microbatches)
        setup.optimizer.step(1e-2)
        return before, {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        destroy_parallel()


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "trained"])
def test_freeze_router_keeps_every_router_tensor_and_trains_the_rest(freeze):
    before, after = _one_step(freeze)
    routers = [n for n in before if ".mlp.router." in n]
    assert len(routers) == 2 * TINY.num_hidden_layers  # weight and bias of every MoE layer
    for n in routers:
        assert torch.equal(before[n], after[n]) == freeze, n
    moved = [n for n in before if n not in routers and not torch.equal(before[n], after[n])]
    assert len(moved) == len(before) - len(routers)
