"""The decoding loop: batched prompts (left-padded), greedy or temperature/top-p sampling, stop tokens, streaming.

Pure computation on a built HybridModel (no files, no tokenizer): token ids in, token ids out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from gptoss_cli.model.decode.kv_cache import KVCache, forward_cached, next_token_logits, prefill

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
    drop = before >= top_p
    drop[..., 0] = False  # a top_p below fp32's smallest number would otherwise drop every token
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row of fp32 logits [B, V], on the logits' device (the generator's device)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return sample_probs(torch.softmax(logits / sampling.temperature, dim=-1), sampling, generator)


def sample_probs(probs: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """`choose`'s draw from probs = softmax(logits / temperature) [B, V]: cut to the top_p nucleus, sampled."""
    return torch.multinomial(top_p_filter(probs, sampling.top_p), 1, generator=generator).squeeze(-1)


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


@dataclass
class DecodeTiming:
    """Filled by `generate_ids`: seconds by `clock` of the prefill (the prompts through the model, up to
    the first token's logits) and of the decoding after it (every later step), and the steps run."""

    clock: Callable[[], float] = time.perf_counter
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0


# Without a streaming callback, the loop asks the device whether every row has stopped once per
# this many steps (a row that stops keeps being fed until then; its extra tokens are dropped).
DONE_CHECK_EVERY = 8


def generate_ids(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    sampling: Sampling = Sampling(),
    on_token: Callable[[int, int], None] | None = None,
    prefill_chunk: int | None = None,
    timing: DecodeTiming | None = None,
) -> list[Generation]:
    """Continue every prompt (a batch, left-padded) until it emits a token of `stop_ids` or has
    `max_new_tokens` new tokens. `on_token(row, token_id)` is called for each new token as it comes.

    The prompt is fed once (in chunks) into a preallocated KVCache; each step then feeds one token
    per row. Tokens are chosen on the model's device and stay there, in one [B, max_new_tokens]
    tensor, until the end: without `on_token` nothing is read back per step (whether every row has
    stopped is asked once every DONE_CHECK_EVERY steps); with it, each step's tokens come back in
    one transfer, for streaming. A finished row keeps being fed (its tokens are discarded) until
    every row is done."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    timing = timing if timing is not None else DecodeTiming()
    device = model.output_layer.weight.device
    generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(int(sampling.seed))
    t0 = timing.clock()
    ids, pos = left_pad(prompts, device)
    cache = KVCache(model, batch=len(prompts), capacity=ids.shape[1] + max_new_tokens)
    logits = prefill(model, ids, pos, cache, **({} if prefill_chunk is None else {"chunk": prefill_chunk}))
    t1 = timing.clock()
    out = torch.empty(len(prompts), max_new_tokens, dtype=torch.long, device=device)
    stops = torch.tensor(sorted(set(int(t) for t in stop_ids)), dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    streamed = _Streamed(len(prompts), max_new_tokens, set(stops.tolist()), on_token) if on_token else None
    next_pos = pos[:, -1:] + 1
    steps = 0
    while True:
        token = choose(logits, sampling, generator)
        out[:, steps] = token
        steps += 1
        if streamed is not None:
            if streamed.push(token.tolist()):
                break
        elif len(stops):
            done |= torch.isin(token, stops)
            if steps % DONE_CHECK_EVERY == 0 and bool(done.all()):
                break
        if steps == max_new_tokens:
            break
        logits = next_token_logits(model, forward_cached(model, token[:, None], next_pos, cache))
        next_pos = next_pos + 1
    rows = out[:, :steps].tolist()
    timing.prefill_s, timing.decode_s, timing.steps = t1 - t0, timing.clock() - t1, steps
    return [_finished(list(p), row, set(stops.tolist()), max_new_tokens) for p, row in zip(prompts, rows)]


class _Streamed:
    """The rows' progress on the host when tokens are streamed: each step's tokens once, in order."""

    def __init__(self, rows: int, max_new_tokens: int, stops: set[int], on_token: Callable[[int, int], None]):
        self.counts, self.done = [0] * rows, [False] * rows
        self.max_new, self.stops, self.on_token = max_new_tokens, stops, on_token

    def push(self, tokens: list[int]) -> bool:
        """Hand the step's tokens of the unfinished rows to the callback; True once every row is done."""
        for row, t in enumerate(tokens):
            if not self.done[row]:
                self.counts[row] += 1
                self.on_token(row, t)
                self.done[row] = t in self.stops or self.counts[row] >= self.max_new
        return all(self.done)


def _finished(prompt: list[int], row: list[int], stops: set[int], max_new_tokens: int) -> Generation:
    """One row's result: its tokens up to and including the first stop token."""
    for i, t in enumerate(row):
        if t in stops:
            return Generation(prompt, row[:i + 1], STOP_TOKEN, t)
    return Generation(prompt, row, MAX_NEW_TOKENS if len(row) >= max_new_tokens else None)
