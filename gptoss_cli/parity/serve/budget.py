"""How far a serving engine's logprobs may lie from gptoss's, from an error model (never from one run).

Error model. The engine and gptoss compute the same network from the same weights (the served dtype's
rounding of the checkpoint) on the same token ids; they differ only in rounding: where each rounds an
activation to the compute dtype and in which order its dot products add. Each rounding is a relative
error of at most u (unit roundoff: 2**-8 in bf16, 2**-24 in fp32), of random sign and roughly
uniform, so of standard deviation u/sqrt(3). Per sublayer (attention or MoE) an activation element
passes through about R_PER_SUBLAYER roundings (the norm, a GEMM output, the softmax or activation, a
second GEMM, the weighting, the residual add), and every dot product of n terms adds the reassociation
error of an n-term fp32 sum, about sqrt(n) * 2**-24 relative (fp32 accumulation on both sides, bf16
included). Over the 2L sublayers of L blocks these add as a random walk (the residual stream carries
an error forward with gain about 1), so an element of the final normalised hidden state h carries a
relative error of standard deviation

    sigma = sqrt(2L) * (sqrt(R) * u + sqrt(n) * 2**-24) / sqrt(3),   n = max(hidden, intermediate, tokens).

A logit z_i = w_i . h then moves by about sigma * ||w_i * h||_2 (elementwise product), plus its own
rounding u * |z_i|; the largest of V such errors sits within SAFETY = 4 standard deviations. Two
independent implementations differ by sqrt(2) times one's error, and a logprob z_i - logsumexp(z)
moves by at most twice the largest logit error. So, per position,

    budget = 2 * sqrt(2) * max_i (SAFETY * sigma * ||w_i * h||_2 + u * |z_i|),

computed from gptoss's own hidden states and output weights: in fp32 on gpt-oss-20b's sizes that is
about 1e-4 of a logit's scale, in bf16 on the tiny test model about 0.2 nats. What it does not
cover: a router whose k-th and (k+1)-th logits lie within their own rounding error of each other
(a near-tie) may pick another expert on the other side, which moves that token by O(1). Such
positions are found from gptoss's router logits with the same model (the router's input is the
normalised hidden state of its block); gptoss then runs once more with every near-tie router taking
the other expert, and how far that moves its own logprobs at each position (the flipped token, and
the tokens that attend to it) is added to that position's budget. Without near-ties (the rule in
fp32) the budget is the rounding model's alone.
"""

from __future__ import annotations

import math
import torch

SAFETY = 4.0
R_PER_SUBLAYER = 7
U_FP32 = 2.0**-24
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def relative_sigma(dtype: torch.dtype, sublayers: int, n_terms: int) -> float:
    """Standard deviation of the relative error of an activation element after `sublayers` sublayers."""
    u = UNIT_ROUNDOFF[dtype]
    return math.sqrt(max(sublayers, 1)) * (math.sqrt(R_PER_SUBLAYER) * u + math.sqrt(n_terms) * U_FP32) / math.sqrt(3)


def dot_error_bound(weight: torch.Tensor, x: torch.Tensor, out: torch.Tensor, sigma: float, u: float) -> torch.Tensor:
    """Per output element of out = x @ weight.T (+ bias): SAFETY * sigma * ||w_i * x||_2 + u * |out_i|,
    for x [T, H], weight [N, H] -> [T, N] (float64)."""
    spread = (x.double() ** 2) @ (weight.double() ** 2).T
    return SAFETY * sigma * spread.sqrt() + u * out.double().abs()


def logit_budgets(hidden: torch.Tensor, head_weight: torch.Tensor, logits: torch.Tensor, dtype: torch.dtype,
                  num_blocks: int, n_terms: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(budget [T], logit bound [T]) from the final normalised hidden [T, H], the output weight [V, H] and
    the logits [T, V], by the module's model; done in row chunks to bound memory on large vocabularies."""
    sigma = relative_sigma(dtype, 2 * num_blocks, n_terms)
    u = UNIT_ROUNDOFF[dtype]
    bounds = []
    for start in range(0, hidden.shape[0], 64):
        h, z = hidden[start:start + 64], logits[start:start + 64]
        bounds.append(dot_error_bound(head_weight, h, z, sigma, u).max(dim=-1).values)
    bound = torch.cat(bounds)
    return 2 * math.sqrt(2) * bound, math.sqrt(2) * bound


def router_near_ties(router_inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], top_k: int,
                     dtype: torch.dtype, n_terms: int) -> list[torch.Tensor]:
    """Per MoE block, the tokens whose router may choose differently under the other side's rounding
    ([T] bool each): the k-th and (k+1)-th logits lie within the sum of their error bounds.

    `router_inputs`: per MoE block, (input [T, H], weight [E, H], logits [T, E]) from gptoss's forward."""
    u = UNIT_ROUNDOFF[dtype]
    out = []
    for block, (x, weight, logits) in enumerate(router_inputs):
        sigma = relative_sigma(dtype, 2 * block + 1, n_terms)
        err = math.sqrt(2) * dot_error_bound(weight, x, logits, sigma, u)
        order = logits.double().argsort(dim=-1, descending=True)
        kth, next_ = order[:, top_k - 1], order[:, top_k]
        lk = logits.double().gather(1, kth[:, None])[:, 0]
        ln = logits.double().gather(1, next_[:, None])[:, 0]
        slack = err.gather(1, kth[:, None])[:, 0] + err.gather(1, next_[:, None])[:, 0]
        out.append((lk - ln) <= slack)
    return out


__all__ = ["SAFETY", "R_PER_SUBLAYER", "UNIT_ROUNDOFF", "relative_sigma", "dot_error_bound", "logit_budgets", "router_near_ties"]
