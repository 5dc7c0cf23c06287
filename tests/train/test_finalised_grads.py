"""The finalised gradients against plain autograd of the mean token loss on an unwrapped copy of the model.

EP=2 vs EP=1 cannot catch a mistake of the finaliser itself (both sides run it): dividing the expert
gradients by the global token count twice passes them. Here the reference is torch's own backward of
sum(cross_entropy) / tokens on the same weights, with no gradient buffers and no finaliser."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gptoss_cli.model.expert_names import is_expert_name
from gptoss_cli.parallel.grads import unwrap_model
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.data import DataLoaderState
from gptoss_cli.train.objective import forward_step
from gptoss_cli.train.provider import HybridModelProvider
from gptoss_cli.train.setup import setup_model_and_optimizer
from tests.tolerances import reassociation_rel
from tests.train.dist_helpers import reduced_main_grads
from tests.train.jobs import optimizer_config, runtime_config
from tests.train.workers import SEQ, TINY, RandomTokens

GLOBAL, MBS = 4, 2
# same weights and tokens, two orders of fp32 sums: a gradient element sums over the batch's tokens
GRAD_REL = reassociation_rel(GLOBAL * SEQ, 2 * TINY.num_hidden_layers + 1)


def test_finalised_grads_are_autograd_of_the_mean_token_loss_dense_and_expert():
    state = ParallelState()
    provider = HybridModelProvider(runtime_config(aux_loss_coeff=0.0), seed=7)
    setup = setup_model_and_optimizer(provider, state, optimizer_config(), 1e-3)
    data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ), global_batch_size=GLOBAL, micro_batch_size=MBS,
                           dp_rank=0, dp_size=1)
    get_forward_backward_func(setup.config)(forward_step_func=forward_step, data_iterator=data.step_iterator(),
                                            model=setup.model, num_microbatches=data.num_microbatches)
    grad_of = reduced_main_grads(setup.model.grad_buffers.buffers())  # with the division the optimizer would do
    ours = {n: grad_of[id(p)] for n, p in unwrap_model(setup.model).named_parameters()}

    plain = provider.provide(state)  # same seed: the same weights, never wrapped
    with torch.no_grad():
        for (n, p), (m, q) in zip(plain.named_parameters(), unwrap_model(setup.model).named_parameters()):
            assert n == m and torch.equal(p, q), n
    batch = torch.stack([RandomTokens(TINY.vocab_size, SEQ).sample(i) for i in range(GLOBAL)])
    logits = plain(batch[:, :-1]).logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="mean")
    loss.backward()
    reference = {n: p.grad for n, p in plain.named_parameters()}

    assert set(ours) == set(reference)
    assert any(is_expert_name(n) for n in ours) and not all(is_expert_name(n) for n in ours)
    for name, want in reference.items():
        got = ours[name]
        err = (got.double() - want.double()).abs().max().item()
        scale = want.double().abs().max().item()
        ratio = want.double().norm().item() / max(got.double().norm().item(), 1e-30)
        kind = "expert" if is_expert_name(name) else "dense"
        assert err <= GRAD_REL * scale, (
            f"{kind} gradient {name}: max |diff| {err:.3g} vs {GRAD_REL:.2g} x {scale:.3g}; reference / ours = "
            f"{ratio:.4g} (= tokens {GLOBAL * SEQ}: divided by the token count twice; 1/tokens: never divided)")
