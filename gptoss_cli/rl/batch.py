"""A rank's rollout: the completions it sampled, their rewards and advantages, and the microbatches it trains on.

Each completion becomes one row of `training.seq_length` tokens: the prompt from position 0, the
completion after it, then padding (token 0, never a label). The labels are the completion's tokens
at the positions that predict them (the prompt's last token predicts the first), IGNORE_INDEX
elsewhere; `extras` carry, at the same positions, the engine's log-probability of each sampled
token (`rollout_logp`) and the completion's advantage (`advantages`), and, when the rollout scored
them, the trainer's (`old_logp`) and the reference policy's (`ref_logp`). Positions are the default
ones (0.. along the row), the positions the engine sampled at. When the engine reported the experts it
routed each token to, the microbatch's `routes.engine` holds them at the same positions
(rl/routes.py, `rows_routes`; the trainer counts its flips against them and may replay them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from gptoss_cli.model.loss import IGNORE_INDEX
from gptoss_cli.model.routes import ExpertRoutes
from gptoss_cli.rl.routes import rows_routes
from gptoss_cli.train.data import Microbatch


@dataclass
class SampledCompletion:
    """One sampled completion of one prompt."""

    prompt: int  # the prompt's index in the prompt set
    prompt_ids: Sequence[int]
    ids: list[int]
    logprobs: list[float]  # the engine's, of each sampled token
    finish: str = ""  # "stop" (a stop token ended it) or "length"
    # the engine's experts per fed token and MoE layer [prompt + completion - 1, L, k] (rl/routes.py), if reported
    routes: torch.Tensor | None = None


@dataclass
class Rollout:
    """This rank's completions of one rollout, in groups of rl.group_size consecutive completions."""

    index: int  # which rollout (0-based, over the run)
    completions: list[SampledCompletion]
    rewards: list[float | None] = field(default_factory=list)  # None: the reward failed
    advantages: list[float] = field(default_factory=list)
    microbatches: list[Microbatch] = field(default_factory=list)
    seconds: float = 0.0  # sampling and scoring, wall time
    stats: dict[str, float] = field(default_factory=dict)  # metrics.jsonl fields of the rollout (global)


def completion_rows(completions: Sequence[SampledCompletion], advantages: Sequence[float], seq_length: int,
                    device: torch.device) -> Microbatch:
    """One microbatch of the given completions (see the module docstring)."""
    n = len(completions)
    tokens = torch.zeros(n, seq_length, dtype=torch.long)
    labels = torch.full((n, seq_length), IGNORE_INDEX, dtype=torch.long)
    engine = torch.zeros(n, seq_length, dtype=torch.float32)
    adv = torch.zeros(n, seq_length, dtype=torch.float32)
    for i, (c, a) in enumerate(zip(completions, advantages)):
        p, m = len(c.prompt_ids), len(c.ids)
        if p + m > seq_length:
            raise ValueError(f"a row of {p} prompt + {m} completion tokens exceeds training.seq_length={seq_length}")
        tokens[i, :p] = torch.tensor(list(c.prompt_ids), dtype=torch.long)
        tokens[i, p:p + m] = torch.tensor(c.ids, dtype=torch.long)
        labels[i, p - 1:p + m - 1] = torch.tensor(c.ids, dtype=torch.long)
        engine[i, p - 1:p + m - 1] = torch.tensor(c.logprobs, dtype=torch.float32)
        adv[i] = float(a)
    routes = rows_routes(completions, seq_length)
    return Microbatch(tokens=tokens.to(device), labels=labels.to(device),
                      extras={"rollout_logp": engine.to(device), "advantages": adv.to(device)},
                      routes=None if routes is None else ExpertRoutes(engine=routes.to(device)))


def split_microbatches(rollout: Rollout, micro_batch_size: int, seq_length: int,
                       device: torch.device) -> list[Microbatch]:
    """The rollout's completions in order, micro_batch_size rows per microbatch."""
    out = []
    for start in range(0, len(rollout.completions), micro_batch_size):
        out.append(completion_rows(rollout.completions[start:start + micro_batch_size],
                                   rollout.advantages[start:start + micro_batch_size], seq_length, device))
    return out


def step_microbatches(rollout: Rollout, step_in_rollout: int, per_step: int) -> Iterator[Microbatch]:
    """The microbatches optimizer step `step_in_rollout` of the rollout trains on (`per_step` of them)."""
    return iter(rollout.microbatches[step_in_rollout * per_step:(step_in_rollout + 1) * per_step])


__all__ = ["SampledCompletion", "Rollout", "completion_rows", "split_microbatches", "step_microbatches"]
