"""gptoss's own rollout engine: `generate`'s KV-cache decoding on the training model, with the log-probability
of every sampled token, on every rank, in step with the expert-parallel group.

The decoding is gptoss_cli/generate's: prompts left-padded (model/decode/kv_cache.py: padding has position
-1, no query sees it), prefill in chunks, then one token per row per step; the token is chosen as
generate chooses it (`choose`: softmax(logits / temperature), cut to the top_p nucleus, sampled with
the rollout's generator). The log-probability reported for it is that of the distribution it was
drawn from: log softmax(logits / temperature), less the log of the nucleus' mass when top_p < 1
(what vLLM's `processed_logprobs` reports). The model's layers are the training model's own (its
kernels, FP8 or MXFP4 QAT GEMMs, LoRA adapters).

Under expert parallelism every MoE layer is an all-to-all over the EP group, so the group's ranks
must run the same forwards: each batch's padded width is the group's widest (prompts padded further
left), and decoding continues while any rank of the group has a row that has not stopped (one
all-reduce of a flag per token step). A rank whose rows have all stopped keeps feeding them, as
generate does for finished rows; their tokens are discarded.

With `routes=True` each completion also carries the experts every MoE layer sent each of its tokens
to (routing replay, model/routes.py, docs/rl.md "Routing replay"): a [prompt + completion - 1, MoE
layers, k] tensor of global expert ids (uint8 up to 256 experts) on the host, from the prefill (the
prompt's tokens) and the decoding steps (every sampled token but the last, which is never fed back),
left padding dropped. Under expert parallelism the ids are the layer's own routing over the group.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from gptoss_cli.generate.decode import Sampling, choose, left_pad, top_p_filter
from gptoss_cli.model.decode.kv_cache import KVCache, forward_cached, next_token_logits, prefill


def _group_max(value: int, group) -> int:
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def token_log_prob(logits: torch.Tensor, token: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[B] log-probability of `token` under the distribution `choose` samples from (see the module docstring)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = logp.gather(-1, token[:, None])[:, 0]
    if top_p < 1.0:
        kept = top_p_filter(torch.softmax(logits.float() / temperature, dim=-1), top_p).sum(-1)
        picked = picked - torch.log(kept)
    return picked


@torch.no_grad()
def sample_batch(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
                 sampling: Sampling, generator: torch.Generator, group=None, routes: bool = False,
                 ) -> list[tuple]:
    """(token ids, their log-probabilities, "stop" | "length") of one completion per prompt, and with
    `routes` the experts its tokens went to (see the module docstring)."""
    device = model.output_layer.weight.device
    stops = set(int(t) for t in stop_ids)
    width = _group_max(max(len(p) for p in prompts), group)
    ids, pos = left_pad([list(p) for p in prompts], device)
    if ids.shape[1] < width:  # the group's widest: padding has id 0 and position -1
        pad = width - ids.shape[1]
        ids = torch.cat([ids.new_zeros(ids.shape[0], pad), ids], 1)
        pos = torch.cat([pos.new_full((pos.shape[0], pad), -1), pos], 1)
    cache = KVCache(model, batch=ids.shape[0], capacity=ids.shape[1] + max_new_tokens)
    chosen: list | None = [] if routes else None
    logits = prefill(model, ids, pos, cache, routes_out=chosen)
    next_pos = pos[:, -1:] + 1
    out: list[tuple[list[int], list[float], str]] = [([], [], "") for _ in prompts]
    for step in range(max_new_tokens):
        token = choose(logits, sampling, generator)
        logp = token_log_prob(logits, token, sampling.temperature, sampling.top_p).tolist()
        for row, (toks, lps, finish) in enumerate(out):
            if finish:
                continue
            t = int(token[row])
            toks.append(t)
            lps.append(logp[row])
            if t in stops:
                out[row] = (toks, lps, "stop")
            elif len(toks) >= max_new_tokens:
                out[row] = (toks, lps, "length")
        running = int(any(not finish for _, _, finish in out))
        if not _group_max(running, group):
            break
        hidden = forward_cached(model, token[:, None], next_pos, cache, routes_out=chosen)
        logits = next_token_logits(model, hidden)
        next_pos = next_pos + 1
    if chosen is None:
        return out
    columns = torch.cat(chosen, dim=1).cpu()
    return [(*row, _row_routes(columns, r, len(p), width, len(row[0]))) for r, (row, p) in enumerate(zip(out, prompts))]


def _row_routes(columns: torch.Tensor, row: int, prompt: int, width: int, completion: int) -> torch.Tensor:
    """Row `row`'s fed tokens' ids [prompt + completion - 1, L, k] from the ids of every column fed
    [B, columns, L, k] (its prompt starts at column width - prompt; its last sampled token, and whatever
    was fed after it stopped, are not its)."""
    return columns[row, width - prompt:width + completion - 1].clone()


def sample_completions(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
                       sampling: Sampling, generator: torch.Generator, batch_size: int | None = None,
                       group=None, routes: bool = False) -> list[tuple]:
    """`sample_batch` over `prompts` in batches of `batch_size` rows (None: all at once). Every rank of
    `group` must pass the same number of prompts and batch size."""
    batch = batch_size or len(prompts)
    out = []
    for start in range(0, len(prompts), batch):
        out += sample_batch(model, prompts[start:start + batch], max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                            sampling=sampling, generator=generator, group=group, routes=routes)
    return out


__all__ = ["sample_batch", "sample_completions", "token_log_prob"]
