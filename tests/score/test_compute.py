"""The scores of one position (label log-prob, top-K, tail mass) against an independent float64 computation.

Reference: float64 log_softmax of the same logits (divided by T), its top K by sorting, and the tail
mass as the float64 sum of exp(log-prob) outside them, logged. Tolerance: each fp32 log-prob z/T - lse
is rounded in the division by T, the logsumexp and the difference, each at most half an ulp of the
largest |z/T|, so 4 ulp of it bounds them (1.5e-5 at the peaked logits' 117 / 0.7). The tail is
compared in log space (a relative error of its mass) at the same bound, also when it is 1e-30 of the
mass, which a difference 1 - sum(top K) in fp32 cannot resolve at all.
"""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.score.compute import score_chunk, score_positions

V = 97


def reference(logits: torch.Tensor, labels: torch.Tensor, k: int, temperature: float = 1.0):
    lp = torch.log_softmax(logits.double() / temperature, -1)
    order = lp.argsort(-1, descending=True)
    top = order[:, :k]
    outside = torch.ones_like(lp, dtype=torch.bool).scatter(-1, top, False)
    tail = torch.where(outside, lp.exp(), torch.zeros_like(lp)).sum(-1).log()
    return lp.gather(1, labels[:, None])[:, 0], top, lp.gather(1, top), tail


def logits_of(kind: str, n: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    z = torch.randn(n, V, generator=g, dtype=torch.float64) * 3
    if kind == "peaked":  # the top 3 hold all but about e^-70 of the mass
        z[:, :3] += 80 + torch.arange(3, dtype=torch.float64)
    return z.float()


@pytest.mark.parametrize("kind", ["spread", "peaked"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_top_k_and_tail_equal_float64(kind, temperature):
    z = logits_of(kind)
    labels = torch.randint(0, V, (z.shape[0],), generator=torch.Generator().manual_seed(1))
    got = score_chunk(z, labels, 3, temperature)
    lp, ids, top_lp, tail = reference(z, labels, 3, temperature)
    tol = 4 * torch.finfo(torch.float32).eps * float(z.abs().max()) / temperature
    torch.testing.assert_close(got.logprobs.double(), lp, atol=tol, rtol=0)
    assert torch.equal(got.topk_ids.long(), ids)  # no ties among these logits
    torch.testing.assert_close(got.topk_logprobs.double(), top_lp, atol=tol, rtol=0)
    assert torch.isfinite(got.tail_logmass).all()
    torch.testing.assert_close(got.tail_logmass.double(), tail, atol=tol, rtol=0)
    if kind == "peaked" and temperature == 1.0:
        assert (tail < -60).all()  # the case a difference of masses cannot represent


def test_the_whole_vocabulary_leaves_no_tail():
    z = logits_of("spread", 4)
    got = score_chunk(z, torch.zeros(4, dtype=torch.long), V)
    assert torch.equal(got.tail_logmass, torch.full((4,), float("-inf")))
    # V fp32 probabilities summed: at most V rounding errors of eps each
    torch.testing.assert_close(got.topk_logprobs.exp().double().sum(-1), torch.ones(4, dtype=torch.float64),
                               atol=V * torch.finfo(torch.float32).eps, rtol=0)


def test_chunks_give_the_rows_the_whole_gives():
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(37, 16, generator=g), torch.randn(V, 16, generator=g)
    labels = torch.randint(0, V, (37,), generator=g)
    whole = score_chunk(hidden.double() @ weight.double().T, labels, 4)
    parts = score_positions(hidden, weight, labels, top_k=4, chunk_tokens=8)
    torch.testing.assert_close(parts.logprobs.double(), whole.logprobs.double(), atol=1e-5, rtol=0)
    torch.testing.assert_close(parts.tail_logmass.double(), whole.tail_logmass.double(), atol=1e-5, rtol=0)
    assert parts.topk_ids.shape == (37, 4) and score_positions(hidden[:0], weight, labels[:0], top_k=4).topk_ids.shape == (0, 4)
