"""What MoE layers report about their routing: the statistics of one forward, the two router losses
pooled over layers (load balancing, z-loss), and the router table the telemetry reads.

Math: docs/architecture.md, "Aux loss"; the table's use: docs/router-telemetry.md. The router itself
(top-k of the raw logits) is model/moe.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptoss_cli.model.dispatcher import expert_counts


@dataclass(frozen=True)
class RouterStatsRequest:
    """What a training forward asks each MoE layer to return about its routing: the telemetry
    (always: counts, entropy) and the differentiable terms of the losses that are on."""

    aux_loss: bool = False  # prob_sum with gradient (load-balancing loss)
    z_loss: bool = False  # z_loss_sum with gradient (router z-loss)


@dataclass
class RouterStats:
    """One layer's routing in one forward (docs/architecture.md, "Aux loss"; docs/router-telemetry.md)."""

    tokens_per_expert: torch.Tensor  # [E] float, top-k assignment counts (no gradient)
    prob_sum: torch.Tensor | None  # [E] float, sum over tokens of softmax(all E logits) (differentiable); aux loss only
    num_tokens: int
    entropy_sum: torch.Tensor | None = None  # scalar, sum over tokens of the entropy of softmax(all E logits) (no gradient)
    z_loss_sum: torch.Tensor | None = None  # scalar, sum over tokens of logsumexp(logits)^2 (differentiable); z-loss only


def router_stats(logits: torch.Tensor, indices: torch.Tensor, num_experts: int,
                 want: RouterStatsRequest) -> RouterStats:
    """The statistics of one layer's routing: logits [T, E], selected indices [T, k]."""
    logits32 = logits.float()
    prob_sum = torch.softmax(logits32, dim=-1).sum(0) if want.aux_loss else None
    z_sum = torch.logsumexp(logits32, dim=-1).square().sum() if want.z_loss else None
    with torch.no_grad():
        log_p = torch.log_softmax(logits32, dim=-1)
        entropy_sum = -(log_p.exp() * log_p).sum()
        counts = expert_counts(indices.reshape(-1), num_experts).float()
    return RouterStats(tokens_per_expert=counts, prob_sum=prob_sum, num_tokens=logits.shape[0],
                       entropy_sum=entropy_sum, z_loss_sum=z_sum)


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor:
    """Mixtral/HF load-balancing loss pooled over layers: `E * sum_e f_e * P_e` with
    f_e = assignments to e / (layers * tokens) and P_e = mean router probability of e.
    Equal to transformers' `load_balancing_loss_func` for the same router logits."""
    total = sum(s.num_tokens for s in stats)
    f = torch.stack([s.tokens_per_expert for s in stats]).sum(0) / total
    p = torch.stack([s.prob_sum for s in stats]).sum(0) / total
    return num_experts * torch.sum(f * p)


def router_z_loss(stats: list[RouterStats]) -> torch.Tensor:
    """Megatron's router z-loss, unscaled, summed over layers as each layer adds its own:
    sum over layers of mean over tokens of logsumexp(logits)^2 (ST-MoE, Zoph et al. 2022)."""
    return sum(s.z_loss_sum / s.num_tokens for s in stats)


# Columns of a router table row: E expert counts, then these two.
ENTROPY_COL, TOKENS_COL = -2, -1


def router_table(stats: list[RouterStats]) -> torch.Tensor:
    """float64 [L, E + 2], one row per MoE layer: tokens routed to each expert (top-k assignments),
    the summed router entropy, the tokens routed. Rows of several microbatches and ranks add up."""
    return torch.stack([
        torch.cat([s.tokens_per_expert.double(), s.entropy_sum.double().reshape(1),
                   s.tokens_per_expert.new_full((1,), float(s.num_tokens), dtype=torch.float64)])
        for s in stats
    ]).detach()




__all__ = ["RouterStatsRequest", "RouterStats", "router_stats", "load_balancing_loss", "router_z_loss",
           "router_table", "ENTROPY_COL", "TOKENS_COL"]
