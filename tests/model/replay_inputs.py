"""Inputs of the routing-replay tests, importable without transformers (spawned EP workers import them):
the tiny preset's token batches, random expert ids per token and MoE layer, loss weights."""

from __future__ import annotations

import torch

from gptoss_cli.model.config import preset
from gptoss_cli.model.routes import NO_ROUTE

TINY = preset("tiny")
L, K, E = TINY.num_hidden_layers, TINY.num_experts_per_tok, TINY.num_local_experts
SEQ = 2 * TINY.sliding_window + 5  # tests/model/conftest.py's
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32, the same sums in another order (tests/model/test_hybrid_vs_transformers.py)


def random_routes(batch: int, seq: int, seed: int = 3, live_every: int | None = 5) -> torch.Tensor:
    """[B, S, L, k] distinct random ids per token and layer; every `live_every`-th position has none (-1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(batch * seq * L)])
    ids = ids.reshape(batch, seq, L, K).to(torch.int16)
    if live_every:
        ids[:, ::live_every] = NO_ROUTE
    return ids


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) [2, SEQ] of random tokens (tests/model/conftest.py's `tokens`), next-token labels."""
    ids = torch.randint(0, TINY.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    ids[ids == 1001] = 0  # transformers' padding id: its embedding row gets no gradient there
    return ids, torch.roll(ids, -1, dims=1)


def weights_for(ids: torch.Tensor) -> torch.Tensor:
    return torch.randn(ids.shape, generator=torch.Generator().manual_seed(9))
