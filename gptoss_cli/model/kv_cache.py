"""A key/value cache for incremental decoding of a HybridModel: bounded on sliding-window layers, sinks exact.

`KVCache(model, batch)` holds, per attention layer, the rotated keys and the values of the tokens
seen so far and the position of each (-1 for left padding, which no query sees). A full-attention
layer keeps every key; a sliding layer of window W keeps only the last W columns, the most any
later query can see (query q sees keys q-W < k <= q, docs/architecture.md "Sliding window").

`forward_cached(model, input_ids, position_ids, cache)` runs new tokens through the stack: the
attention layers attend to cache + new keys with the sink softmax of the reference (one extra
logit per query head, zero value row) and append the new keys; MoE and MLP layers are the model's
own. It returns the final-norm hidden states of the new tokens; `next_token_logits` applies the
LM head to the last one. Prefill and decode are the same call (prefill in chunks bounds the scores
to chunk x keys).
"""

from __future__ import annotations

import torch

from gptoss_cli.model.attention import AttentionLayer
from gptoss_cli.model.hybrid import run_layer

# Queries per call when a long prompt is fed through the cache: the scores of one chunk are
# [batch, heads, chunk, keys] in fp32.
PREFILL_CHUNK = 256


class LayerKVCache:
    """Keys [B, kv_heads, T, d] (after RoPE), values, and key positions [B, T] of one attention layer."""

    def __init__(self, window: int | None):
        self.window = window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Append the new tokens' keys/values; return (keys, values, positions) the new queries attend
        to: what was kept plus the new ones. A sliding layer then keeps only the last `window` columns."""
        if self.keys is None:
            keys, values, pos = k, v, positions
        else:
            keys = torch.cat([self.keys, k], dim=2)
            values = torch.cat([self.values, v], dim=2)
            pos = torch.cat([self.positions, positions], dim=1)
        keep = slice(None) if self.window is None else slice(-self.window, None)
        self.keys, self.values, self.positions = keys[:, :, keep], values[:, :, keep], pos[:, keep]
        return keys, values, pos


def cached_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                          q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Sink attention of queries at explicit positions over keys at explicit positions.

    q [B, heads, n, d], k/v [B, kv_heads, T, d], sinks [heads], q_pos [B, n], k_pos [B, T] (negative:
    padding, never visible) -> [B, heads, n, d]. Key k is visible from query q iff
    0 <= k_pos <= q_pos and, with a window W, k_pos > q_pos - W. Scores and softmax in fp32; the
    sink is one more logit per head in the softmax whose value row is zero (so a query that sees
    no key, a padding row, gets a zero output).
    """
    b, nh, n, d = q.shape
    nkv = k.shape[1]
    r = nh // nkv
    qg = q.float().reshape(b, nkv, r, n, d)  # query head h = g*r + i reads kv head g
    scores = torch.einsum("bgind,bgtd->bgint", qg, k.float()) * d**-0.5
    kp, qp = k_pos[:, None, :], q_pos[:, :, None]
    visible = (kp >= 0) & (kp <= qp)
    if window is not None:
        visible = visible & (kp > qp - window)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    sink = sinks.float().reshape(1, nkv, r, 1, 1).expand(b, nkv, r, n, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("bgint,bgtd->bgind", probs, v.float())
    return out.reshape(b, nh, n, d).to(q.dtype)


class KVCache:
    """One LayerKVCache per attention layer of `model` (indexed by physical layer)."""

    def __init__(self, model):
        self.layers = {
            j: LayerKVCache(layer.self_attention.core_attention.window)
            for j, layer in enumerate(model.decoder.layers) if isinstance(layer, AttentionLayer)
        }
        self.seen = 0  # tokens (columns, left padding included) fed so far

    def max_length(self) -> int:
        """The longest layer's stored columns (the full-attention layers')."""
        return max((len(c) for c in self.layers.values()), default=0)


@torch.no_grad()
def forward_cached(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Feed input_ids [B, n] at position_ids [B, n] (-1 = left padding) through `model`, reading and
    extending `cache`; returns the final-norm hidden states [B, n, H]."""
    x = model.embed(input_ids)
    cos, sin = model.rotary_pos_emb(position_ids.clamp(min=0), x.dtype)
    for j, layer in enumerate(model.decoder.layers):
        if j in cache.layers:
            attn = layer.self_attention
            q, k, v = attn.qkv(x, cos, sin)
            keys, values, k_pos = cache.layers[j].update(k, v, position_ids)
            out = cached_sink_attention(q, keys, values, attn.core_attention.softmax_offset,
                                        position_ids, k_pos, attn.core_attention.window)
            x = x + attn.project_out(out)
        else:
            x = run_layer(layer, x, cos, sin)
    cache.seen += input_ids.shape[1]
    return model.decoder.final_norm(x)


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
            chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """`forward_cached` over a prompt in chunks of `chunk` tokens; returns the logits [B, V] of the
    last position (the distribution of the first new token)."""
    hidden = None
    for start in range(0, input_ids.shape[1], chunk):
        hidden = forward_cached(model, input_ids[:, start:start + chunk], position_ids[:, start:start + chunk], cache)
    return next_token_logits(model, hidden)


def next_token_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """LM head of the last position of final-norm hidden states [B, n, H] -> fp32 logits [B, V]."""
    return torch.nn.functional.linear(hidden[:, -1], model.output_layer.weight).float()
