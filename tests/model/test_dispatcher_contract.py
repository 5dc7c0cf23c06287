"""The dispatcher's contract, checked directly: every (token, choice) pair is one row, even when two of a
token's top-k slots name the same expert (the router never does that today; the dispatcher allows it)."""

from __future__ import annotations

import torch

from gptoss_cli.model.dispatcher import AllToAllTokenDispatcher


def _reference(hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor, num_experts: int):
    """A plain loop over (token, choice): rows per expert and sum_j prob_j x (expert_j + 1) x hidden."""
    counts = [0] * num_experts
    out = torch.zeros_like(hidden)
    for t in range(indices.shape[0]):
        for j in range(indices.shape[1]):
            e = int(indices[t, j])
            counts[e] += 1
            out[t] += probs[t, j] * (e + 1) * hidden[t]
    return counts, out


def test_a_token_whose_top_k_slots_repeat_an_expert_is_dispatched_once_per_slot():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 8, generator=g, dtype=torch.float64).requires_grad_()
    # tokens 0, 2 and 5 name one expert in both slots; token 3 in all three of its slots below
    indices = torch.tensor([[2, 2, 0], [1, 3, 0], [0, 0, 1], [3, 3, 3], [0, 1, 2], [1, 1, 2]])
    probs = torch.softmax(torch.randn(6, 3, generator=g, dtype=torch.float64), -1)
    d = AllToAllTokenDispatcher(4)
    x, counts, ctx = d.dispatch(hidden, probs, indices)
    want_counts, want_out = _reference(hidden.detach(), probs, indices, 4)
    assert counts.tolist() == want_counts and x.shape[0] == indices.numel(), (counts.tolist(), want_counts)
    scale = torch.repeat_interleave(torch.arange(1, 5, dtype=hidden.dtype), counts)[:, None]
    out = d.combine(x * scale, ctx)  # "expert e multiplies by e+1"
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    out.sum().backward()  # d out_t / d hidden_t = sum_j prob_j (e_j + 1), each slot counted
    want_grad = (probs * (indices + 1)).sum(-1, keepdim=True).expand_as(hidden)
    torch.testing.assert_close(hidden.grad, want_grad, rtol=1e-12, atol=1e-12)
