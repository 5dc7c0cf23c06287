"""How far a serving engine's logprobs may lie from gptoss's, from an error model (never from one run).

Error model. The engine and gptoss compute the same network from the same weights (the served dtype's
rounding of the checkpoint) on the same token ids; they differ only in rounding: where each rounds an
activation to the compute dtype and in which order its dot products add. Each rounding is a relative
error of at most u (unit roundoff: 2**-8 in bf16, 2**-24 in fp32), of random sign and roughly
uniform, so of standard deviation u/sqrt(3), and every dot product or row sum of n terms adds the
reassociation error of an n-term fp32 sum, about sqrt(n) * 2**-24 relative (fp32 accumulation on both
sides, bf16 included; n = max(hidden, intermediate, head size, tokens)). Where a block rounds is
ROUNDING_POINTS: a module's output with its number of roundings r, so a point leaves a relative error of
standard deviation

    s(point) = (sqrt(r) * u + sqrt(n) * 2**-24) / sqrt(3)        (no sum term for the residual add).

How far those errors reach a logprob depends on the weights: attention's softmax over sharpened scores,
a norm over a small residual, a grown output layer each scale what reaches them, and a GRPO run moves
the weights step by step. (The budget once assumed a gain of 1 per sublayer, sigma = sqrt(2L) *
(sqrt(R) * u + sqrt(n) * 2**-24) / sqrt(3) on the final hidden state with R = 7 roundings per sublayer,
`relative_sigma`; that held at a model's initial weights and fell behind the ones training made.) So
the model's own layers carry them (reference.py, `rounding_spread`): gptoss runs the forward once more
over ROUNDING_SAMPLES rows of the same ids, each row's output of every rounding point multiplied by
(1 + s * xi), xi drawn from N(0, 1) per element, every router held to the experts it chose in the plain
forward (a choice a rounding can change is a near-tie, below). The draws are `amplification` times
larger than s (the smallest at INJECTED_FLOOR, far above the forward's own fp32 rounding and well inside
its linear response: 2**-16 and 2**-13 give the same budget to 1%) and the logprobs' response is scaled back
by as much. The output layer's own rounding, sqrt(n) * 2**-24 * ||w_i * h||_2 + u * |z_i| over sqrt(3)
per logit (`head_rounding_sd`), is drawn on each row's logits at its size and reaches the logprobs
through the log-sum-exp to first order. Each position's `spread` is the largest over the vocabulary of
the root mean square over the rows of how far its logprob moved: one implementation's error, from the
weights being checked (for a GRPO push, the policy pushed). The largest of V such errors sits within
SAFETY = 4 standard deviations and two independent implementations differ by sqrt(2) times one's, so,
per position,

    budget = sqrt(2) * SAFETY * spread,

in fp32 on the tiny test model with head size 64 about 3e-5 to 6e-5 nats. What it does not cover: a
router whose k-th and (k+1)-th logits lie within their own rounding error of each other (a near-tie)
may pick another expert on the other side, which moves that token by O(1). Such positions are found
from gptoss's router logits with the same model (the router's input is the normalised hidden state of
its block; `router_near_ties`, still with the gain-1 sigma of its block); gptoss then runs once more
with every near-tie router taking the other expert, and how far that moves its own logprobs at each
position (the flipped token, and the tokens that attend to it) is added to that position's budget.
Without near-ties (the rule in fp32) the budget is the rounding model's alone.
"""

from __future__ import annotations

import math
import torch

SAFETY = 4.0
R_PER_SUBLAYER = 7
ROUNDING_SAMPLES = 8  # rows of the forward that carries the roundings (reference.py, rounding_spread)
INJECTED_FLOOR = 2.0**-13  # the smallest relative draw made (then scaled back): far above fp32's own rounding
# Where a block rounds, as the modules whose outputs carry it: (roundings, whether a dot product or a sum over
# the row ends there). "residual" is each decoder layer's output (the add).
ROUNDING_POINTS = {
    "linear_qkv": (2, True),  # the input norm's output, the QKV GEMM's
    "core_attention": (3, True),  # the scores, the softmax with the sink, the probabilities times V
    "linear_proj": (1, True),
    "pre_mlp_layernorm": (1, True),
    "linear_fc1": (2, True),  # the GEMM's output, the clamped SwiGLU's
    "linear_fc2": (2, True),  # the GEMM's output, the routing weight and the sum over the chosen experts
    "final_norm": (1, True),
    "residual": (1, False),
}
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


def point_sigma(dtype: torch.dtype, point: str, n_terms: int) -> float:
    """Standard deviation of the relative error one rounding point of ROUNDING_POINTS leaves on an element."""
    roundings, reduces = ROUNDING_POINTS[point]
    return (math.sqrt(roundings) * UNIT_ROUNDOFF[dtype] + (math.sqrt(n_terms) * U_FP32 if reduces else 0.0)) / math.sqrt(3)


def amplification(dtype: torch.dtype, n_terms: int) -> float:
    """How much larger than the model's roundings they are drawn (then scaled back): the smallest is INJECTED_FLOOR."""
    return max(1.0, INJECTED_FLOOR / min(point_sigma(dtype, p, n_terms) for p in ROUNDING_POINTS))


def head_rounding_sd(hidden: torch.Tensor, head: torch.Tensor, logits: torch.Tensor, dtype: torch.dtype,
                     n_terms: int) -> torch.Tensor:
    """Per logit [T, V] (float64), the standard deviation of the output layer's own rounding: the reassociation of
    its H-term dot product, sqrt(n) * 2**-24 * ||w_i * h||_2, and the logit's rounding, u * |z_i|, over sqrt(3)."""
    u = UNIT_ROUNDOFF[dtype]
    rows = []
    for start in range(0, hidden.shape[0], 64):
        h, z = hidden[start:start + 64].double(), logits[start:start + 64].double()
        spread = ((h ** 2) @ (head.double() ** 2).T).sqrt()
        rows.append((math.sqrt(n_terms) * U_FP32 * spread + u * z.abs()) / math.sqrt(3))
    return torch.cat(rows)


def logit_budgets(spread: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(budget [T], logit bound [T]) from the propagated `spread` [T] (the module's model): the largest logprob
    difference between the two sides at each position, and the bound on one (the same: the spread is the largest
    over the vocabulary already)."""
    budget = math.sqrt(2) * SAFETY * spread.double()
    return budget.cpu(), budget.cpu()


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


__all__ = ["SAFETY", "R_PER_SUBLAYER", "ROUNDING_SAMPLES", "INJECTED_FLOOR", "ROUNDING_POINTS", "UNIT_ROUNDOFF",
           "relative_sigma", "dot_error_bound", "point_sigma", "amplification", "head_rounding_sd", "logit_budgets",
           "router_near_ties"]
