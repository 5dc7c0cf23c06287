"""The distillation divergences against TRL's `generalized_jsd_loss` (full vocabulary) and an independent
float64 computation (the teacher's top-K and tail), values and gradients.

Everything here is float64 (the logits and the references), so the only differences are the order of
sums: a relative error model of 1e-12 per operation over a vocabulary of a few hundred terms stays far
below the 1e-9 the tests allow; a sign, a swapped direction, a missing tail bucket or a temperature applied
to one side only moves the values by 1e-2 or more.

TRL's reference is `GKDTrainer.generalized_jsd_loss` (trl 1.16, trl/experimental/gkd): beta = 0 is the
forward KL(teacher || student), beta = 1 the reverse KL(student || teacher), in between the generalised
JSD; both sides divided by the temperature, the sum over trained tokens divided by `num_items_in_batch`.
"""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.distill.losses import Divergence, distill_terms
from gptoss_cli.model.loss import IGNORE_INDEX

N, H, V, K = 13, 16, 97, 7
RTOL = 1e-9


@pytest.fixture(scope="module")
def trl_jsd():
    from trl.experimental.gkd.gkd_trainer import GKDTrainer  # the reference (about 10 s to import)

    return GKDTrainer.generalized_jsd_loss


def _problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    t_hidden = torch.randn(N, H + 3, generator=g, dtype=torch.float64)  # a teacher of another width
    t_weight = torch.randn(V, H + 3, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[[2, 5]] = IGNORE_INDEX
    return hidden, weight, t_hidden, t_weight, labels


CASES = [("forward_kl", 0.0, 1.0), ("reverse_kl", 1.0, 1.0), ("jsd", 0.3, 1.0), ("jsd", 0.7, 2.0),
         ("forward_kl", 0.0, 0.5), ("reverse_kl", 1.0, 3.0)]


@pytest.mark.parametrize("loss,beta,temperature", CASES)
def test_full_vocabulary_equals_trl_generalized_jsd_values_and_gradients(trl_jsd, loss, beta, temperature):
    hidden, weight, t_hidden, t_weight, labels = _problem(1)
    trained = labels != IGNORE_INDEX
    ours_h, ours_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    spec = Divergence(loss, beta if loss == "jsd" else 0.5, temperature)
    terms = distill_terms(ours_h, ours_w, labels, trained, spec, chunk=4, teacher_hidden=t_hidden,
                          teacher_weight=t_weight)
    mean = terms.loss / terms.tokens
    mean.backward()

    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = trl_jsd((ref_h @ ref_w.T)[None], (t_hidden @ t_weight.T)[None], labels=labels[None], beta=beta,
                  temperature=temperature, num_items_in_batch=int(trained.sum()))
    ref.backward()
    assert float(terms.tokens) == int(trained.sum())
    torch.testing.assert_close(mean.detach(), ref.detach(), rtol=RTOL, atol=0)
    torch.testing.assert_close(ours_h.grad, ref_h.grad, rtol=RTOL, atol=1e-12)
    torch.testing.assert_close(ours_w.grad, ref_w.grad, rtol=RTOL, atol=1e-12)


def _independent_topk(z_s: torch.Tensor, z_t: torch.Tensor, loss: str, beta: float, temperature: float):
    """Per position, the divergence over the teacher's K ids and 'any other token', from probabilities (not
    log-probabilities): softmax, sums and 1 - sum in float64, one position at a time."""
    out = []
    for zs, zt in zip(z_s, z_t):
        ps, pt = torch.softmax(zs / temperature, -1), torch.softmax(zt / temperature, -1)
        ids = torch.argsort(pt, descending=True)[:K]
        s = torch.cat([ps[ids], (1 - ps[ids].sum())[None]])
        t = torch.cat([pt[ids], (1 - pt[ids].sum())[None]])
        kl = lambda p, q: (p * torch.log(p / q)).sum()  # noqa: E731
        if loss == "forward_kl":
            out.append(kl(t, s))
        elif loss == "reverse_kl":
            out.append(kl(s, t))
        else:
            m = beta * t + (1 - beta) * s
            out.append(beta * kl(t, m) + (1 - beta) * kl(s, m))
    return torch.stack(out)


@pytest.mark.parametrize("loss,beta,temperature", CASES)
def test_topk_with_tail_bucket_equals_an_independent_float64_computation(loss, beta, temperature):
    hidden, weight, t_hidden, t_weight, labels = _problem(2)
    trained = labels != IGNORE_INDEX
    t_log = torch.log_softmax(t_hidden @ t_weight.T / temperature, -1)
    values, ids = t_log.topk(K, -1)
    tail = torch.log1p(-values.exp().sum(-1))  # float64: no cancellation at these sizes
    ours_h = hidden.clone().requires_grad_()
    spec = Divergence(loss, beta if loss == "jsd" else 0.5, temperature)
    terms = distill_terms(ours_h, weight, labels, trained, spec, chunk=5,
                          teacher_topk=(ids, values, tail))
    terms.loss.backward()

    ref_h = hidden.clone().requires_grad_()
    per = _independent_topk((ref_h @ weight.T)[trained], (t_hidden @ t_weight.T)[trained], loss, beta, temperature)
    per.sum().backward()
    torch.testing.assert_close(terms.loss.detach(), per.sum().detach(), rtol=RTOL, atol=0)
    torch.testing.assert_close(ours_h.grad, ref_h.grad, rtol=RTOL, atol=1e-12)
