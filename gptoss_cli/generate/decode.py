"""The decoding loop: batched prompts (left-padded), greedy or temperature/top-p sampling, stop tokens, streaming.

Pure computation on a built HybridModel (no files, no tokenizer): token ids in, token ids out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from gptoss_cli.model.kv_cache import KVCache, forward_cached, next_token_logits, prefill

STOP_TOKEN = "stop_token"
MAX_NEW_TOKENS = "max_new_tokens"


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (argmax, ties to the lowest id as torch.argmax does); otherwise the
    softmax of logits / temperature, cut to the smallest set of most likely tokens whose probability
    reaches top_p, sampled with a generator seeded by `seed`."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Generation:
    """One prompt's result: the new token ids (the stop token included when one ended it)."""

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    stop_reason: str | None = None  # STOP_TOKEN or MAX_NEW_TOKENS
    stop_token: int | None = None


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every probability outside the nucleus: the most likely tokens, in order, until their sum
    reaches top_p (the first is always kept). probs [B, V] -> [B, V], not renormalised."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the tokens ranked above each
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row of fp32 logits [B, V]."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = top_p_filter(torch.softmax(logits / sampling.temperature, dim=-1), sampling.top_p)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def left_pad(prompts: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, S], position_ids [B, S]) with each prompt right-aligned; padding has id 0 and
    position -1 (no query sees it), real tokens positions 0.. from each prompt's own start."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    pos = torch.full((len(prompts), width), -1, dtype=torch.long)
    for row, p in enumerate(prompts):
        if p:
            ids[row, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            pos[row, width - len(p):] = torch.arange(len(p))
    return ids.to(device), pos.to(device)


def generate_ids(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    sampling: Sampling = Sampling(),
    on_token: Callable[[int, int], None] | None = None,
    prefill_chunk: int | None = None,
) -> list[Generation]:
    """Continue every prompt (a batch, left-padded) until it emits a token of `stop_ids` or has
    `max_new_tokens` new tokens. `on_token(row, token_id)` is called for each new token as it comes.

    The prompt is fed once (in chunks) into a KVCache; each step then feeds one token per row.
    A finished row keeps being fed (its tokens are discarded) until every row is done."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = model.output_layer.weight.device
    stops = set(int(t) for t in stop_ids)
    results = [Generation(prompt_ids=list(p)) for p in prompts]
    generator = None if sampling.greedy else torch.Generator().manual_seed(int(sampling.seed))
    ids, pos = left_pad(prompts, device)
    cache = KVCache(model)
    kwargs = {} if prefill_chunk is None else {"chunk": prefill_chunk}
    logits = prefill(model, ids, pos, cache, **kwargs)
    next_pos = pos[:, -1:] + 1
    for step in range(max_new_tokens):
        token = choose(logits, sampling, generator)
        for row, res in enumerate(results):
            if res.stop_reason is not None:
                continue
            t = int(token[row])
            res.output_ids.append(t)
            if on_token is not None:
                on_token(row, t)
            if t in stops:
                res.stop_reason, res.stop_token = STOP_TOKEN, t
            elif len(res.output_ids) >= max_new_tokens:
                res.stop_reason = MAX_NEW_TOKENS
        if all(r.stop_reason is not None for r in results):
            break
        hidden = forward_cached(model, token[:, None], next_pos, cache)
        logits = next_token_logits(model, hidden)
        next_pos = next_pos + 1
    return results
