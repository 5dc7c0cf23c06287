"""The LM head's reused buffers (model/workspace.py, model/lm_head.py): reuse changes no bit, and no buffer is
overwritten while something still reads it.

Reuse is judged against the same computation with every buffer a fresh tensor
(GPTOSS_LM_HEAD_BUFFERS=fresh): the same ops on the same inputs, so any difference at all is a bug
(a buffer read before it was written, or after the next chunk, microbatch or rollout step wrote
it). Before each reused run every kept buffer is filled with NaN, so such a read cannot pass by
luck. What the fused functions compute is checked against fp64 autograd of the plain expressions,
within the reassociation bound of tests/tolerances.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gptoss_cli.model import workspace
from gptoss_cli.model.lm_head import chunked_log_probs
from gptoss_cli.model.loss import IGNORE_INDEX, chunked_lm_loss_sum
from tests.tolerances import reassociation_rel

N, H, V, CHUNK = 37, 16, 301, 8  # 5 chunks, the last one short
TEMPERATURE = 0.7


def _inputs(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, V, (N,), generator=g)
    upstream = torch.randn(N, generator=g)  # the gradient reaching the log-probs from a loss
    return hidden, weight, labels, upstream


def _loss(hidden, weight, labels, upstream):
    labels = labels.clone()
    labels[[3, 17]] = IGNORE_INDEX
    loss = chunked_lm_loss_sum(hidden, weight, labels, CHUNK)
    (1.5 * loss).backward()
    return [loss.detach()]


def _log_probs(hidden, weight, labels, upstream):
    logp, entropy = chunked_log_probs(hidden, weight, labels, TEMPERATURE, CHUNK)
    (logp * upstream).sum().backward()
    return [logp.detach(), entropy]


def _token_log_probs(hidden, weight, labels, upstream):
    logp, none = chunked_log_probs(hidden, weight, labels, 1.0, CHUNK, with_entropy=False)
    assert none is None
    (logp * upstream).sum().backward()
    return [logp.detach()]


def _run(fn, dtype, seed: int = 0) -> list[torch.Tensor]:
    hidden, weight, labels, upstream = _inputs(dtype, seed)
    out = fn(hidden, weight, labels, upstream)
    return [t.clone() for t in out] + [hidden.grad.clone(), weight.grad.clone()]


@pytest.fixture
def fresh_workspace():
    workspace.release()
    yield
    workspace.release()


FUNCTIONS = {"loss": _loss, "log_probs": _log_probs, "token_log_probs": _token_log_probs}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_reused_buffers_change_no_bit_of_the_results_or_gradients(name, dtype, fresh_workspace, monkeypatch):
    fn = FUNCTIONS[name]
    monkeypatch.setenv(workspace.BUFFERS_ENV, "fresh")
    want = _run(fn, dtype)
    assert workspace.kept_bytes() == 0
    monkeypatch.delenv(workspace.BUFFERS_ENV)
    _run(fn, dtype, seed=1)  # the buffers now exist, holding another run's values...
    workspace.fill_kept(float("nan"))  # ...and then NaN
    got = _run(fn, dtype)
    assert workspace.kept_bytes() > 0  # the run did reuse them
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_no_tensor_returned_or_saved_for_backward_lies_in_a_kept_buffer(fresh_workspace):
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    hidden, weight, labels, upstream = _inputs(torch.float32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, entropy = chunked_log_probs(hidden, weight, labels, TEMPERATURE, CHUNK)
        ratio = torch.exp(logp - logp.detach() + 0.1)  # what GRPO's loss does with them next
        objective = -(torch.minimum(ratio * upstream, ratio.clamp(0.8, 1.2) * upstream)).sum()
        loss = chunked_lm_loss_sum(hidden, weight, labels, CHUNK)
    kept = workspace.kept_storages()
    assert kept  # the chunks went through kept buffers
    assert saved  # and autograd saved something downstream of them
    held = [*saved, logp, entropy, loss, objective]
    assert not {t.untyped_storage().data_ptr() for t in held} & kept


@pytest.mark.parametrize("name", ["loss", "log_probs"])
def test_a_second_microbatch_forward_before_the_first_backward_disturbs_nothing(name, fresh_workspace, monkeypatch):
    """Two microbatches' forwards, then their backwards (as a pipeline or the overlap schedule runs
    them): the gradients are those of each microbatch run alone, bit for bit."""
    def forward(fn_inputs):
        hidden, weight, labels, upstream = fn_inputs
        if name == "loss":
            return 1.5 * chunked_lm_loss_sum(hidden, weight, labels, CHUNK)
        logp, _ = chunked_log_probs(hidden, weight, labels, TEMPERATURE, CHUNK)
        return (logp * upstream).sum()

    def microbatches():
        first = _inputs(torch.float32, seed=0)
        second = list(_inputs(torch.float32, seed=2))
        second[1] = first[1]  # one output layer, two microbatches of hidden states
        return first, second

    monkeypatch.setenv(workspace.BUFFERS_ENV, "fresh")
    first, second = microbatches()
    forward(first).backward()
    forward(second).backward()
    want = [first[0].grad, second[0].grad, first[1].grad]
    monkeypatch.delenv(workspace.BUFFERS_ENV)
    first, second = microbatches()
    loss_1 = forward(first)
    loss_2 = forward(second)
    workspace.fill_kept(float("nan"))
    loss_1.backward()
    loss_2.backward()
    for g, w in zip([first[0].grad, second[0].grad, first[1].grad], want, strict=True):
        assert torch.equal(g, w)


def test_chunked_log_probs_equal_fp64_autograd(fresh_workspace):
    hidden, weight, labels, upstream = _inputs(torch.float32)
    logp, entropy = chunked_log_probs(hidden, weight, labels, TEMPERATURE, CHUNK)
    (logp * upstream).sum().backward()
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    all64 = torch.log_softmax(F.linear(h64, w64) / TEMPERATURE, -1)
    want = all64.gather(-1, labels[:, None])[:, 0]
    (want * upstream.double()).sum().backward()
    want_entropy = -(all64.exp() * all64).sum(-1)
    # fp32 against exact: a logit is an H-term dot product, the log-softmax a V-term sum; the gradients
    # one GEMM more (dhidden over V, dW over the N tokens)
    rel = reassociation_rel(n_terms=H + V, depth=2)
    for got, exact in ((logp, want), (entropy, want_entropy), (hidden.grad, h64.grad), (weight.grad, w64.grad)):
        assert (got.double() - exact.detach()).abs().max() <= rel * exact.detach().abs().max()
