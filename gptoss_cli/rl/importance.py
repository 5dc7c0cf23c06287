"""Importance-sampling corrections for the trainer/engine mismatch: the weight each completion token's loss gets.

The engine sampled each token from its own distribution; the trainer's log-probability of it at the rollout's
weights (`old`) differs by rounding, another kernel, another precision, a flipped expert. With
d_t = old_t - engine_t over the completion's tokens and rho_t = exp(d_t) (p_trainer / p_engine), the PPO
term of token t is multiplied by (`rl.is_correction`):

    tis      clamp(rho_t, is_min, is_max)                      token-level truncated IS
    mis      rho_t if rho_t <= is_max else 0                   token-level masked IS (a one-sided mask)
    icepop   rho_t if is_min <= rho_t <= is_max else 0         IcePop's two-sided token mask
    seq_tis  clamp(rho_seq, is_min, is_max) on every token     sequence-level truncated IS
    seq_mis  rho_seq if is_min <= rho_seq <= is_max else 0     sequence-level masked IS
    none     1

(is_min null: no lower bound) where rho_seq is the completion's geometric-mean ratio exp(mean_t d_t)
(`rl.is_sequence_ratio: geometric`) or the product of its ratios exp(sum_t d_t) (`product`). These are TRL's
GRPOTrainer vLLM corrections (`vllm_importance_sampling_mode`: token_truncate, token_mask, sequence_truncate,
sequence_mask; `vllm_importance_sampling_clip_min` / `_clip_max`) on the same inputs; TRL's sequence ratio is the
product, which tests/rl/test_trl_parity.py compares directly, and the geometric mean is TRL's sequence mode fed the
per-token differences divided by the completion's length. The weight has no gradient (old and engine are fixed),
and the KL term is not weighted (TRL's order). A masked token keeps its place in the normalisation: a completion
whose every token is masked contributes 0 to the grpo mean over completions and still counts in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gptoss_cli.recipe.schema import IS_CORRECTIONS, IS_SEQUENCE_RATIOS as SEQUENCE_RATIOS

# rl.is_correction's truncating, masking and sequence-level choices
TRUNCATING = ("tis", "seq_tis")
MASKING = ("mis", "icepop", "seq_mis")
SEQUENCE_LEVEL = ("seq_tis", "seq_mis")
# TRL's vllm_importance_sampling_mode of each correction (tests/rl/test_trl_parity.py runs TRL's code with it)
TRL_MODES = {"tis": "token_truncate", "mis": "token_mask", "icepop": "token_mask", "seq_tis": "sequence_truncate",
             "seq_mis": "sequence_mask"}


@dataclass(frozen=True)
class ImportanceCorrection:
    """One rl.is_correction with its bounds (see the module docstring)."""

    mode: str = "tis"
    is_min: float | None = None
    is_max: float = 3.0
    sequence_ratio: str = "geometric"

    def __post_init__(self):
        if self.mode not in IS_CORRECTIONS:
            raise ValueError(f"is_correction {self.mode!r} is not one of {' | '.join(IS_CORRECTIONS)}")
        if self.sequence_ratio not in SEQUENCE_RATIOS:
            raise ValueError(f"is_sequence_ratio {self.sequence_ratio!r} is not one of {' | '.join(SEQUENCE_RATIOS)}")

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def bounds(self) -> tuple[float, float]:
        """(lower, upper) of the ratio kept as it is; mis has no lower bound whatever is_min says."""
        low = -math.inf if self.is_min is None or self.mode == "mis" else self.is_min
        return low, self.is_max

    def weights(self, d: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, outside) per position of `d` = (old - engine) [rows, S], `mask` the completion tokens (1.0/0.0):
        the weight each token's PPO term is multiplied by (1 off the mask), and 1.0 where the ratio fell outside
        the bounds (truncated or masked; on every token of such a completion at the sequence level), 0 elsewhere."""
        d = d * mask
        if self.mode in SEQUENCE_LEVEL:
            total = d.sum(-1, keepdim=True)
            d = total / mask.sum(-1, keepdim=True).clamp(min=1.0) if self.sequence_ratio == "geometric" else total
        ratio = torch.exp(d)
        if not self.active:
            return torch.ones_like(ratio).expand_as(mask), torch.zeros_like(mask)
        low, high = self.bounds()
        outside = ((ratio < low) | (ratio > high)).to(mask.dtype)
        if self.mode in TRUNCATING:
            weight = torch.clamp(ratio, min=self.is_min, max=self.is_max)
        else:
            weight = ratio.masked_fill(outside.bool(), 0.0)
        return weight.expand_as(mask), outside.expand_as(mask) * mask


def masked_sequences(outside: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Completions (rows with completion tokens) every token of which is outside the bounds: the ones a masking
    correction leaves with no gradient."""
    tokens = mask.sum(-1)
    return ((outside * mask).sum(-1) == tokens) & (tokens > 0)


__all__ = ["ImportanceCorrection", "IS_CORRECTIONS", "TRUNCATING", "MASKING", "SEQUENCE_LEVEL", "SEQUENCE_RATIOS",
           "TRL_MODES", "masked_sequences"]
