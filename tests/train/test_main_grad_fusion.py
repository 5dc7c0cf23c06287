"""Weight gradients a backward adds straight into main_grad (gptoss_cli/model/gemm/main_grad.py).

The experts' grouped linear, the chunked LM head and the embedding accumulate their weight gradients into the
training buffers' main_grad themselves and hand autograd a stand-in the buffers' hook discards.
References are independent of that path: per-expert matmuls, F.linear + F.cross_entropy and
F.embedding under plain autograd, on clones of the same weights. main_grad starts from a non-zero value (an earlier
microbatch's gradient), so a kernel that overwrote instead of adding fails, and the loss is
scaled by a factor that is not 1, so a backward that ignored its incoming gradient fails.
The whole-model check (every parameter, two microbatches, dense and expert) is
tests/train/test_finalised_grads.py; against transformers, tests/train/test_train_reference.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gptoss_cli.errors import TrainingError
from gptoss_cli.model.gemm.grouped import grouped_linear
from gptoss_cli.model.loss import chunked_lm_loss_sum
from gptoss_cli.model.gemm.main_grad import embedding, take_added
from gptoss_cli.parallel import grads
from gptoss_cli.parallel.grads import GradAccumulatingModel, unwrap_model
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.data import DataLoaderState
from gptoss_cli.train.objective import forward_step
from gptoss_cli.train.provider import HybridModelProvider
from gptoss_cli.train.setup import setup_model_and_optimizer
from tests.tolerances import reassociation_rel
from tests.train.jobs import optimizer_config, runtime_config
from tests.train.workers import SEQ, TINY, RandomTokens

SCALE = 0.375  # the incoming gradient of the loss (a loss scale, a 1/microbatches factor)


def _close(got: torch.Tensor, want: torch.Tensor, n_terms: int, what: str) -> None:
    # fp32 sums of n_terms products in two orders (tests/tolerances.py)
    err = (got.double() - want.double()).abs().max().item()
    assert err <= reassociation_rel(n_terms) * want.double().abs().max().item(), f"{what}: max |diff| {err:.3g}"


def test_expert_weight_gradient_is_added_into_main_grad_per_expert():
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 9, 2])  # an expert without tokens keeps its main_grad
    x = torch.randn(16, 24, generator=g)
    w = nn.Parameter(torch.randn(4, 40, 24, generator=g))
    b = nn.Parameter(torch.randn(4, 40, generator=g))
    dy = torch.randn(16, 40, generator=g)
    before = torch.randn(4, 40, 24, generator=g)
    w.main_grad = before.clone()

    grouped_linear(x, w, b, counts).backward(dy * SCALE)
    assert take_added(w, w.grad)  # autograd received the stand-in, not a gradient to add

    ref_w = w.detach().clone().requires_grad_(True)
    rows = torch.split(x, counts.tolist())
    out = torch.cat([r @ ref_w[e].t() for e, r in enumerate(rows)])
    (out * dy * SCALE).sum().backward()
    _close(w.main_grad - before, ref_w.grad, int(counts.max()), "expert weight gradient")
    assert torch.equal(w.main_grad[1], before[1])


def test_lm_head_weight_gradient_is_scaled_and_added_into_main_grad():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(11, 16, generator=g)  # 11 tokens in chunks of 4: a short last chunk
    w = nn.Parameter(torch.randn(37, 16, generator=g))
    labels = torch.randint(0, 37, (11,), generator=g)
    labels[3] = -100
    before = torch.randn(37, 16, generator=g)
    w.main_grad = before.clone()

    (SCALE * chunked_lm_loss_sum(hidden, w, labels, chunk_tokens=4)).backward()
    assert take_added(w, w.grad)

    ref_w = w.detach().clone().requires_grad_(True)
    (SCALE * F.cross_entropy(F.linear(hidden, ref_w), labels, ignore_index=-100, reduction="sum")).backward()
    _close(w.main_grad - before, ref_w.grad, hidden.shape[0], "output layer gradient")


def test_embedding_gradient_is_index_added_into_main_grad():
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([[4, 1, 4], [0, 4, 6]])  # a repeated row sums its tokens' gradients
    w = nn.Parameter(torch.randn(7, 5, generator=g))
    dy = torch.randn(2, 3, 5, generator=g)
    before = torch.randn(7, 5, generator=g)
    w.main_grad = before.clone()

    embedding(ids, w).backward(dy * SCALE)
    assert take_added(w, w.grad)

    ref_w = w.detach().clone().requires_grad_(True)
    F.embedding(ids, ref_w).backward(dy * SCALE)
    _close(w.main_grad - before, ref_w.grad, 3, "embedding gradient")
    assert torch.equal(w.main_grad[[2, 3, 5]], before[[2, 3, 5]])  # rows without tokens untouched


def test_without_training_buffers_the_gradients_are_returned_as_before():
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([3, 4])
    x = torch.randn(7, 8, generator=g)
    w = nn.Parameter(torch.randn(2, 16, 8, generator=g))
    b = nn.Parameter(torch.zeros(2, 16))
    grouped_linear(x, w, b, counts).sum().backward()
    want = torch.stack([torch.ones(16, 3) @ x[:3], torch.ones(16, 4) @ x[3:]])
    _close(w.grad, want, 4, "expert weight gradient without buffers")
    assert not take_added(w, w.grad)


def test_the_training_step_fuses_the_expert_weights_the_output_layer_and_the_embedding(monkeypatch):
    """Which parameters the hook found already in main_grad in a real step (two microbatches):
    every expert weight, the output layer and the embedding, and nothing else."""
    fused, seen = set(), set()
    names = {}

    def spy(param, grad):
        taken = take_added(param, grad)
        seen.add(names[id(param)])
        if taken:
            fused.add(names[id(param)])
        return taken

    monkeypatch.setattr(grads, "take_added", spy)
    state = ParallelState()
    setup = setup_model_and_optimizer(HybridModelProvider(runtime_config(aux_loss_coeff=0.0), seed=7), state,
                                      optimizer_config(), 1e-3)
    names.update({id(p): n for n, p in unwrap_model(setup.model).named_parameters()})
    data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ), global_batch_size=4, micro_batch_size=2,
                           dp_rank=0, dp_size=1)
    get_forward_backward_func(setup.config)(forward_step_func=forward_step, data_iterator=data.step_iterator(),
                                            model=setup.model, num_microbatches=data.num_microbatches)
    expected = {n for n in names.values() if n in ("output_layer.weight", "embedding.word_embeddings.weight") or
                (".mlp.experts." in n and n.endswith(".weight"))}
    assert seen == set(names.values())
    assert fused == expected and any("linear_fc2" in n for n in fused)


def test_a_weight_used_twice_in_one_graph_is_an_error_not_a_wrong_gradient():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 8, 8))
            self.b = nn.Parameter(torch.zeros(2, 8))

        def forward(self, x, counts):
            return grouped_linear(grouped_linear(x, self.w, self.b, counts), self.w, self.b, counts)

    model = GradAccumulatingModel(Twice(), ParallelState())
    with pytest.raises(TrainingError, match="used twice"):
        model(torch.randn(5, 8), torch.tensor([2, 3])).sum().backward()
