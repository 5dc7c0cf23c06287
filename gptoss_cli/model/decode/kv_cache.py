"""A preallocated key/value cache for incremental decoding of a HybridModel: bounded on sliding-window layers, sinks exact.

`KVCache(model, batch, capacity)` allocates, per attention layer, the rotated keys and the values
of `capacity` columns (prompt + new tokens; a column is one step of every row, left padding
included) once: a full-attention layer keeps every column; a sliding layer of window W keeps a
ring of the last W columns, the most any later query can see (query q sees keys q-W < k <= q,
docs/architecture.md "Sliding window"). Which column a slot holds and at what position (-1: left
padding, which no query sees) is shared by the layers of one window (`_Columns`), so the masks are
built once per step, not per layer.

`forward_cached(model, input_ids, position_ids, cache)` runs new tokens through the stack: the
attention layers write the new keys into their slots and attend to what the cache holds with the
sink softmax of the reference (one extra logit per query head, zero value row); MoE and MLP layers
are the model's own (a decoding step's MoE layer computes only the chosen experts,
model/decode/moe.py). It returns the final-norm hidden states of the new tokens;
`next_token_logits` applies the LM head to the last one. Prefill and decode are the same call
(prefill in chunks bounds the scores to chunk x keys).

The attention is one fused kernel per layer where torch has one that returns the log-sum-exp (the
CPU flash kernel): plain attention over the cached keys gives `out` and `lse`, and the sink only
rescales, `out * exp(lse - logaddexp(lse, sink_h))` (model/attention/sink_flash.py says why). Elsewhere the
same softmax is computed explicitly (`cached_sink_attention`, also the reference the tests hold the
kernel path to). Nothing here reads a tensor back to the host: the column counters are Python ints
that advance by one per step for every row.
"""

from __future__ import annotations

import torch

from gptoss_cli import torch_private
from gptoss_cli.model.attention.layer import AttentionLayer
from gptoss_cli.model.hybrid import run_layer
from gptoss_cli.model.decode.moe import DecodeExperts, decode_moe, decode_moe_available
from gptoss_cli.model.decode.skinny_gemm import skinny_linear
from gptoss_cli.model.moe import MoELayer
from gptoss_cli.model.routes import LayerRoutes, routes_dtype

# Queries per call when a long prompt is fed through the cache: the scores of one chunk are
# [batch, heads, chunk, keys].
PREFILL_CHUNK = 256

_FLASH = torch_private.has_cpu_flash_attention()  # False: a torch build without the CPU flash kernel
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def cached_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                          q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Sink attention of queries at explicit positions over keys at explicit positions, computed
    explicitly (the reference of the fused path, and the path where no fused kernel exists).

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
    visible = _visible(q_pos, k_pos, window)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    sink = sinks.float().reshape(1, nkv, r, 1, 1).expand(b, nkv, r, n, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("bgint,bgtd->bgind", probs, v.float())
    return out.reshape(b, nh, n, d).to(q.dtype)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, n, T]: key t visible from query i (the rule of `cached_sink_attention`)."""
    kp, qp = k_pos[:, None, :], q_pos[:, :, None]
    visible = (kp >= 0) & (kp <= qp)
    if window is not None:
        visible = visible & (kp > qp - window)
    return visible


def fused_available(q: torch.Tensor) -> bool:
    """Whether the fused path runs for q: the CPU flash kernel, a plain CPU tensor of a dtype it computes."""
    return _FLASH and q.device.type == "cpu" and q.dtype in _FLASH_DTYPES and type(q) is torch.Tensor


def fused_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                         mask: torch.Tensor | None) -> torch.Tensor:
    """The sink softmax through the CPU flash kernel: q [B, heads, n, d], k/v [B, kv_heads, T, d]
    (views into the cache), `mask` additive [B, 1, n, T] in q's dtype (0 visible, -inf not) or None
    (every key visible) -> [B, heads, n, d]. A query row that sees no key gets zeros (the kernel's
    output there), as the explicit form gives."""
    out, lse = torch_private.cpu_flash_attention(q, k, v, attn_mask=mask, scale=q.shape[-1] ** -0.5)
    keep = torch.exp(lse - torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1)))
    return out.mul_(keep.unsqueeze(-1).to(out.dtype))


class _Columns:
    """Which column each slot of the layers of one window holds: positions [B, slots] (-1: empty or
    left padding) and, for decoding, the additive mask of the slots [B, 1, 1, slots] (None while no
    slot holds padding: then every filled slot is visible)."""

    def __init__(self, batch: int, slots: int, ring: bool, device, dtype):
        self.slots, self.ring = slots, ring
        self.positions = torch.full((batch, slots), -1, dtype=torch.long, device=device)
        self.mask: torch.Tensor | None = None
        self.dtype = dtype

    def filled(self, seen: int) -> int:
        return min(seen, self.slots)

    def write_index(self, start: int, n: int) -> torch.Tensor | slice:
        """The slots of columns start .. start+n-1 (a ring keeps the last `slots` of them: the
        caller writes only those)."""
        if not self.ring:
            return slice(start, start + n)
        first = max(start, start + n - self.slots)
        cols = torch.arange(first, start + n, device=self.positions.device)
        return cols % self.slots

    def record(self, start: int, positions: torch.Tensor) -> None:
        """Note the positions [B, n] of columns start .. start+n-1 (after a prefill chunk)."""
        n = positions.shape[1]
        kept = positions[:, max(0, n - self.slots):] if self.ring else positions
        self.positions[:, self.write_index(start, n)] = kept
        if bool((positions < 0).any()):
            self.mask = torch.zeros(self.positions.shape[0], 1, 1, self.slots, dtype=self.dtype,
                                    device=self.positions.device)
        if self.mask is not None:
            self.mask[:, 0, 0, self.write_index(start, n)] = torch.where(
                kept >= 0, 0.0, float("-inf")).to(self.dtype)

    def decode_slot(self, column: int) -> int:
        return column % self.slots if self.ring else column

    def decoded(self, column: int) -> None:
        """Column `column` (one real token per row) is written: its slot is visible from now on."""
        if self.mask is not None:
            self.mask[:, 0, 0, self.decode_slot(column)] = 0.0


class LayerKVCache:
    """Keys and values [B, kv_heads, slots, d] (after RoPE) of one attention layer, preallocated."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int, columns: _Columns, window: int | None,
                 device, dtype):
        self.window, self.columns = window, columns
        self.keys = torch.zeros(batch, kv_heads, columns.slots, head_dim, device=device, dtype=dtype)
        self.values = torch.zeros_like(self.keys)


class KVCache:
    """One LayerKVCache per attention layer of `model` (indexed by physical layer), for `batch` rows
    and `capacity` columns (the longest prompt plus the new tokens)."""

    def __init__(self, model, batch: int = 1, capacity: int = 1024):
        arch = model.arch
        param = model.output_layer.weight
        device, dtype = param.device, param.dtype
        self.capacity = capacity
        self.by_window: dict[int | None, _Columns] = {}
        self.layers: dict[int, LayerKVCache] = {}
        for j, layer in enumerate(model.decoder.layers):
            if not isinstance(layer, AttentionLayer):
                continue
            window = layer.self_attention.core_attention.window
            ring = window is not None and window < capacity
            if window not in self.by_window:
                self.by_window[window] = _Columns(batch, window if ring else capacity, ring, device, dtype)
            self.layers[j] = LayerKVCache(batch, arch.num_key_value_heads, arch.head_dim, self.by_window[window],
                                          window, device, dtype)
        # MoE layers whose decoding steps run on the chosen experts alone (model/decode/moe.py)
        self.moe_layers = {j: DecodeExperts(layer) for j, layer in enumerate(model.decoder.layers)
                           if decode_moe_available(layer)}
        self.seen = 0  # columns (left padding included) fed so far

    def max_length(self) -> int:
        """The longest layer's stored columns (the full-attention layers')."""
        return max((c.filled(self.seen) for c in self.by_window.values()), default=0)


def _attend_chunk(cache: LayerKVCache, q, k, v, sinks, q_pos, start: int, masks: dict) -> torch.Tensor:
    """A prefill chunk of n columns at `start`: attend to the cached columns and the new ones, then
    keep the new keys (a ring keeps the last W columns)."""
    cols, n = cache.columns, k.shape[2]
    if cols.ring:  # the ring's old columns and the new ones, in any order: the mask decides
        filled = cols.filled(start)
        keys = torch.cat([cache.keys[:, :, :filled], k], dim=2)
        values = torch.cat([cache.values[:, :, :filled], v], dim=2)
        k_pos = torch.cat([cols.positions[:, :filled], q_pos], dim=1)
    else:
        cache.keys[:, :, start:start + n] = k
        cache.values[:, :, start:start + n] = v
        keys, values = cache.keys[:, :, :start + n], cache.values[:, :, :start + n]
        k_pos = torch.cat([cols.positions[:, :start], q_pos], dim=1)
    if fused_available(q):
        if cache.window not in masks:
            visible = _visible(q_pos, k_pos, cache.window)
            masks[cache.window] = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~visible, float("-inf"))[:, None]
        out = fused_sink_attention(q, keys, values, sinks, masks[cache.window])
    else:
        out = cached_sink_attention(q, keys, values, sinks, q_pos, k_pos, cache.window)
    if cols.ring:
        index = cols.write_index(start, n)
        cache.keys[:, :, index] = k[:, :, -len(index):]
        cache.values[:, :, index] = v[:, :, -len(index):]
    return out


def _attend_step(cache: LayerKVCache, q, k, v, sinks, q_pos, column: int) -> torch.Tensor:
    """One decoding step (n = 1 per row) at `column`: write the new key into its slot, attend to the
    filled slots (a ring holds exactly the last W columns, the window of the new query)."""
    cols = cache.columns
    slot = cols.decode_slot(column)
    cache.keys[:, :, slot:slot + 1] = k
    cache.values[:, :, slot:slot + 1] = v
    filled = cols.filled(column + 1)
    keys, values = cache.keys[:, :, :filled], cache.values[:, :, :filled]
    if fused_available(q):
        mask = None if cols.mask is None else cols.mask[..., :filled]
        return fused_sink_attention(q, keys, values, sinks, mask)
    return cached_sink_attention(q, keys, values, sinks, q_pos, cols.positions[:, :filled], cache.window)


@torch.no_grad()
def forward_cached(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                   prompt: bool = False, routes_out: list | None = None) -> torch.Tensor:
    """Feed input_ids [B, n] at position_ids [B, n] (-1 = left padding) through `model`, reading and
    extending `cache`; returns the final-norm hidden states [B, n, H].

    One column of real tokens (a decoding step, `prompt` False) writes its slot and attends to the
    filled ones; prompt columns (any n, padding allowed) build their masks from the positions.
    `routes_out`: the global expert ids every MoE layer sent the new tokens to, [B, n, MoE layers, k],
    is appended to it (a rollout's routes, model/routes.py; under expert parallelism the layer's own
    forward routes them, so the ids are global there too)."""
    n, start = input_ids.shape[1], cache.seen
    step = n == 1 and not prompt
    if start + n > cache.capacity:
        raise ValueError(f"the KV cache holds {cache.capacity} columns; {start} + {n} do not fit")
    x = model.embed(input_ids)
    cos, sin = model.rotary_pos_emb(position_ids.clamp(min=0), x.dtype)
    masks: dict = {}
    if step:  # the new column's slot: its position, and visible from now on
        for cols in cache.by_window.values():
            cols.positions[:, cols.decode_slot(start)] = position_ids[:, 0]
            cols.decoded(start)
    chosen: list | None = None if routes_out is None else []
    for j, layer in enumerate(model.decoder.layers):
        if j in cache.layers:
            attn, layer_cache = layer.self_attention, cache.layers[j]
            q, k, v = attn.qkv(x, cos, sin)
            sinks = attn.core_attention.softmax_offset
            if step:
                out = _attend_step(layer_cache, q, k, v, sinks, position_ids, start)
            else:
                out = _attend_chunk(layer_cache, q, k, v, sinks, position_ids, start, masks)
            x = x + attn.project_out(out)
        elif step and j in cache.moe_layers:
            x = decode_moe(cache.moe_layers[j], x, chosen)
        elif chosen is not None and isinstance(layer, MoELayer):
            recorded = LayerRoutes(record=True)
            x = layer(x, None, recorded)
            chosen.append(recorded.live)
        else:
            x = run_layer(layer, x, cos, sin)
    if not step:
        for cols in cache.by_window.values():
            cols.record(start, position_ids)
    cache.seen += n
    if routes_out is not None and chosen:  # stored narrow at once: a rollout keeps every column's
        ids = torch.stack(chosen, dim=1).to(routes_dtype(model.arch.num_local_experts))
        routes_out.append(ids.reshape(input_ids.shape[0], n, len(chosen), -1))
    return model.decoder.final_norm(x)


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
            chunk: int = PREFILL_CHUNK, routes_out: list | None = None) -> torch.Tensor:
    """`forward_cached` over a prompt in chunks of `chunk` tokens; returns the logits [B, V] of the
    last position (the distribution of the first new token). `routes_out`: see forward_cached."""
    hidden = None
    for start in range(0, input_ids.shape[1], chunk):
        hidden = forward_cached(model, input_ids[:, start:start + chunk], position_ids[:, start:start + chunk], cache,
                                prompt=True, routes_out=routes_out)
    return next_token_logits(model, hidden)


@torch.no_grad()
def next_token_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """LM head of the last position of final-norm hidden states [B, n, H] -> fp32 logits [B, V]
    (a few rows against the vocabulary: model/decode/skinny_gemm.py)."""
    return skinny_linear(hidden[:, -1], model.output_layer.weight).float()
