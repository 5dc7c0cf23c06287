"""The language-model loss computed chunk by chunk (model/loss.py) equals the loss of the full logits.

Error model (tests/tolerances.py): both forms compute every logit by the same H-term dot product
and every token's cross-entropy by the same function (token_cross_entropy); what changes is the
order of the sums over tokens (the loss, and dW = sum over tokens of dlogits^T h, add up chunk by
chunk) and possibly the GEMM's blocking of the H-term sums. So the two agree within the
reassociation bound of max(tokens, H) terms, two levels deep (logits, then the sums over tokens).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.loss import IGNORE_INDEX, chunked_lm_loss_sum, token_cross_entropy
from tests.model.conftest import TINY, tokens
from tests.tolerances import assert_tensors_close, reassociation_rel

T, H, V = 37, 24, 53


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g).mul_(0.3).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::5] = IGNORE_INDEX
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, 7, T, 4 * T])
def test_chunked_loss_and_gradients_equal_the_full_logits_loss(chunk):
    hidden, weight, labels = _inputs()
    got = chunked_lm_loss_sum(hidden, weight, labels, chunk)
    got_grads = torch.autograd.grad(3.0 * got, (hidden, weight))  # an incoming gradient other than 1
    want = token_cross_entropy(F.linear(hidden, weight), labels, reduction="sum")
    want_grads = torch.autograd.grad(3.0 * want, (hidden, weight))
    rel = reassociation_rel(max(T, H), depth=2)
    names = ("loss", "dhidden", "dweight")
    assert_tensors_close(dict(zip(names, (got, *got_grads))), dict(zip(names, (want, *want_grads))), rel)


def test_chunked_loss_without_grad_is_the_same_loss():
    hidden, weight, labels = _inputs()
    with torch.no_grad():
        got = chunked_lm_loss_sum(hidden, weight, labels, 7)
    want = token_cross_entropy(F.linear(hidden, weight), labels, reduction="sum")
    assert abs(float(got) - float(want)) <= reassociation_rel(max(T, H), depth=2) * abs(float(want))


def test_model_loss_and_gradients_do_not_depend_on_the_chunking():
    # The model's loss goes through the chunked form; against the loss of its full logits
    # (`output.logits`, computed on access) every parameter's gradient must agree.
    torch.manual_seed(0)
    model = HybridModel(TINY).eval()  # no router aux loss: the LM loss alone
    ids = tokens()
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)
    model.loss_chunk_tokens = 5
    out = model(ids, labels=labels)
    chunked = dict(zip((n for n, _ in model.named_parameters()), torch.autograd.grad(out.loss, model.parameters())))
    full_out = model(ids)
    full = token_cross_entropy(full_out.logits, labels)
    reference = dict(zip((n for n, _ in model.named_parameters()), torch.autograd.grad(full, model.parameters())))
    assert_tensors_close({"loss": out.loss.detach(), **chunked}, {"loss": full.detach(), **reference},
                         reassociation_rel(max(ids.numel(), TINY.hidden_size), depth=2))
