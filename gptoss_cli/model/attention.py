"""GQA self-attention with learned sinks, sliding windows, YaRN RoPE and biases (reference section 2).

Layout follows Megatron's Hybrid attention layer so that parameter names are the checkpoint's:
`self_attention.linear_qkv.{layer_norm_weight,weight,bias}` (the input RMSNorm fused into the QKV
projection, as Transformer Engine's LayerNormLinear does), `self_attention.core_attention.
softmax_offset` (the sinks) and `self_attention.linear_proj.{weight,bias}`.

The fused QKV rows are grouped by kv head (section 4): for kv group g, the r = heads/kv query
heads g*r .. g*r+r-1, then k_g, then v_g.

Sinks are what section 2 says they are: one extra softmax column per query head whose value is
zero. Two ways compute them (`sink_attention` picks per device):
  * on the CPU, model/sink_flash.py: the CPU flash kernel's attention over the real keys and its
    log-sum-exp, rescaled by the sink, with its own backward; q, k, v keep their head dim.
  * elsewhere (GPU, meta), padded: we append one feature to q (the sink logit) and to k
    (sqrt(head_dim) on a single extra key, zero on the real keys), so the extra key scores exactly
    `sink_h` and the real keys score exactly `q.k / sqrt(head_dim)`; its value row is zero. Any
    SDPA backend then computes the sink softmax, gradients to the sinks included, at head dim
    d + 8 (72 for GPT-OSS's 64).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from gptoss_cli.model import sink_flash
from gptoss_cli.model.catalog import SLIDING_QUERY_BLOCK
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.context_parallel import head_range, heads_to_seq, seq_to_heads
from gptoss_cli.model.dense_gemm import DenseAdapter, DenseGemm, Linear, attached_adapter, linear
from gptoss_cli.model.norm import rms_norm
from gptoss_cli.model.recompute import checkpointed, without_output
from gptoss_cli.model.rope import apply_rotary


@functools.lru_cache(maxsize=16)
def attention_mask(seq_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean [seq, seq+1] mask; column 0 is the sink key (always visible), then the real keys.

    Key k is visible from query q iff `q - W < k <= q` (W keys including itself, section 2), or
    `k <= q` without a window.
    """
    q = torch.arange(seq_len, device=device)[:, None]
    k = torch.arange(seq_len, device=device)[None, :]
    visible = k <= q
    if window is not None:
        visible = visible & (k > q - window)
    sink = torch.ones(seq_len, 1, dtype=torch.bool, device=device)
    return torch.cat([sink, visible], dim=1)


@functools.lru_cache(maxsize=64)
def _window_block_mask(rows: int, keys: int, offset: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean [rows, 1 + keys] mask of one query block: sink column, then keys k0 .. k0+keys-1 for
    queries a .. a+rows-1, offset = a - k0; the visibility rule of `attention_mask`."""
    q = torch.arange(rows, device=device)[:, None] + offset
    k = torch.arange(keys, device=device)[None, :]
    visible = (k <= q) & (k > q - window)
    return torch.cat([torch.ones(rows, 1, dtype=torch.bool, device=device), visible], dim=1)


@functools.lru_cache(maxsize=64)
def _window_block_bias(rows: int, keys: int, offset: int, window: int, device: torch.device,
                       dtype: torch.dtype) -> torch.Tensor:
    """`_window_block_mask` without the sink column, additive (0 visible, -inf not) in `dtype`:
    the form the CPU flash kernel takes."""
    visible = _window_block_mask(rows, keys, offset, window, device)[:, 1:]
    return torch.zeros(rows, keys, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    window: int | None,
    padded: bool | None = None,
) -> torch.Tensor:
    """Attention with one sink logit per query head.

    q [B, heads, S, d], k/v [B, kv_heads, S, d], sinks [heads] -> [B, heads, S, d]. Query head h
    reads kv head h // (heads/kv_heads) (SDPA's enable_gqa grouping).

    A sliding-window layer runs attention per block of queries on the keys that block can see
    (the block and the window before it): the kernels take a mask but still compute every
    masked score, so one call would cost S x S where S x (block + window) is the work.

    padded: None picks per device (the log-sum-exp path of model/sink_flash.py where it is
    available, the CPU; the padded head dim elsewhere); True / False force one (benchmarks, tests).
    """
    if not padded and sink_flash.available(q):
        blocks = _query_blocks(q.shape[2], window, q)
        return sink_flash.sink_flash_attention(q, k, v, sinks, blocks, q.shape[-1] ** -0.5)
    if padded is False:
        raise ValueError(f"the unpadded sink attention needs the CPU flash kernel; q is {q.dtype} on {q.device}")
    return _padded_sink_attention(q, k, v, sinks, window)


def _query_blocks(s: int, window: int | None, q: torch.Tensor) -> tuple[sink_flash.Block, ...]:
    """The blocks of `sink_flash`: one causal block without a window (or one as long as the
    sequence), else query blocks of max(SLIDING_QUERY_BLOCK, window) over the keys each can see."""
    if window is None or window >= s:
        return ((0, s, 0, None),)
    block = max(SLIDING_QUERY_BLOCK, window)
    blocks = []
    for start in range(0, s, block):
        stop, k0 = min(s, start + block), max(0, start - window + 1)
        blocks.append((start, stop, k0, _window_block_bias(stop - start, stop - k0, start - k0, window, q.device, q.dtype)))
    return tuple(blocks)


def _padded_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                           window: int | None) -> torch.Tensor:
    """`sink_attention` through SDPA with the sink as one more key: head dim padded to d + 8."""
    b, nh, s, d = q.shape
    nkv = k.shape[1]
    # Extra features padded to a multiple of 8 so fused kernels keep aligned head dims.
    extra = -(-(d + 1) // 8) * 8 - d
    sink_q = sinks.to(q.dtype).view(1, nh, 1, 1).expand(b, nh, s, 1)
    q_aug = torch.cat([q, sink_q, q.new_zeros(b, nh, s, extra - 1)], dim=-1)
    # sqrt(d) is exact in binary for d = 16, 64 (GPT-OSS), so the sink score is exactly sink_h.
    sink_k = k.new_zeros(b, nkv, 1, d + extra)
    sink_k[..., d] = d**0.5
    k_aug = F.pad(k, (0, extra))
    # v gets the zero sink row and the same head dim as q/k: SDPA's fused kernels (the CPU flash
    # kernel among them) need one head dim for q, k and v, else it falls back to its math path.
    # The padded output features are zero and are dropped.
    v_aug = F.pad(v, (0, extra))

    def attend(rows: slice, k0: int, mask: torch.Tensor) -> torch.Tensor:
        keys = torch.cat([sink_k, k_aug[:, :, k0:rows.stop]], dim=2)
        values = F.pad(v_aug[:, :, k0:rows.stop], (0, 0, 1, 0))
        return F.scaled_dot_product_attention(
            q_aug[:, :, rows], keys, values, attn_mask=mask, scale=d**-0.5, enable_gqa=nkv != nh
        )

    block = max(SLIDING_QUERY_BLOCK, window or 0)
    if window is None or window >= s:
        # Causal without a mask, so SDPA skips the blocks above the diagonal (and on GPUs may pick
        # the flash kernel, which takes no mask): with one all-zero query row in front, SDPA's
        # causal rule (query i sees keys 0..i) lets query t see the sink and keys 0..t. That row
        # sees only the sink, whose value row is zero; it is dropped.
        out = F.scaled_dot_product_attention(
            F.pad(q_aug, (0, 0, 1, 0)), torch.cat([sink_k, k_aug], dim=2), F.pad(v_aug, (0, 0, 1, 0)),
            is_causal=True, scale=d**-0.5, enable_gqa=nkv != nh,
        )[:, :, 1:]
    else:
        outs = []
        for start in range(0, s, block):
            stop, k0 = min(s, start + block), max(0, start - window + 1)
            mask = _window_block_mask(stop - start, stop - k0, start - k0, window, q.device)
            outs.append(attend(slice(start, stop), k0, mask))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out[..., :d]


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    window: int | None,
    cu_seqlens: tuple[int, ...] | None,
    padded: bool | None = None,
) -> torch.Tensor:
    """`sink_attention` within documents: no query sees a key of another document.

    cu_seqlens: document start offsets into the flattened [B*S] token stream, 0 .. B*S, that include
    every row start (b*S) (flash-attn's varlen convention; `document_offsets` builds them). Each
    document runs `sink_attention` alone, so its sinks and sliding window apply within it; None =
    one document per row.
    """
    if cu_seqlens is None:
        return sink_attention(q, k, v, sinks, window, padded)
    b, nh, s, d = q.shape
    nkv = k.shape[1]
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != b * s:
        raise ValueError(f"cu_seqlens must run from 0 to batch x seq = {b * s}, got {cu_seqlens[0]} .. {cu_seqlens[-1]}")
    # [B, h, S, d] -> [h, B*S, d]: one token stream, documents are slices of it.
    flat_q = q.transpose(0, 1).reshape(nh, b * s, d)
    flat_k = k.transpose(0, 1).reshape(nkv, b * s, d)
    flat_v = v.transpose(0, 1).reshape(nkv, b * s, d)
    outs = []
    for start, stop in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if start // s != (stop - 1) // s:
            raise ValueError(f"document [{start}, {stop}) crosses a row boundary (rows of {s} tokens)")
        outs.append(sink_attention(flat_q[None, :, start:stop], flat_k[None, :, start:stop],
                                   flat_v[None, :, start:stop], sinks, window, padded)[0])
    return torch.cat(outs, dim=1).view(nh, b, s, d).transpose(0, 1)


class LayerNormLinear(nn.Module):
    """RMSNorm fused with a linear projection: Megatron's `linear_qkv` with `layer_norm_weight`.

    The norm stays in high precision; the projection's GEMMs are `gemm`'s (model/dense_gemm.py); an adapter
    (`adapter`, LoRA's) adds its output, computed from the normalised input.
    With `recompute_norm` the norm's output is not kept for backward (model/recompute.py, layernorm)."""

    gemm: DenseGemm | None = None
    recompute_norm = False

    def __init__(self, in_features: int, out_features: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, device=device, dtype=dtype))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))

    @property
    def adapter(self) -> DenseAdapter | None:
        return attached_adapter(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_norm:
            return without_output(rms_norm, (x, self.layer_norm_weight, self.eps), self._project)
        return self._project(rms_norm(x, self.layer_norm_weight, self.eps))

    def _project(self, normed: torch.Tensor) -> torch.Tensor:
        y = linear(normed, self.weight, self.bias, gemm=self.gemm)
        adapter = self.adapter
        return y if adapter is None else y + adapter(normed)


class CoreAttention(nn.Module):
    """Holds the sinks (`softmax_offset`, one logit per query head) and the window of this layer.
    With `recompute` its layer keeps only the QKV projection's output for backward and recomputes
    the rotary embedding and the core from it (model/recompute.py, core_attn)."""

    recompute = False
    padded = None  # which sink path (`sink_attention`): None = the device's; benchmarks force one

    def __init__(self, num_heads: int, window: int | None, device=None, dtype=None):
        super().__init__()
        self.window = window
        self.softmax_offset = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens: tuple[int, ...] | None = None, heads: slice | None = None) -> torch.Tensor:
        """`heads`: the query heads q holds (context parallel: this rank's chunk), default all."""
        sinks = self.softmax_offset if heads is None else self.softmax_offset[heads]
        return document_attention(q, k, v, sinks, self.window, cu_seqlens, self.padded)

    def extra_repr(self) -> str:
        return f"window={self.window}"


class SelfAttention(nn.Module):
    # Context parallel (model/context_parallel.py): the group whose ranks hold slices of the same
    # sequences; q, k, v go from sequence slices to head slices around core attention. None: off.
    cp_group = None

    def __init__(self, arch: GptOssArch, window: int | None, device=None, dtype=None):
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.linear_qkv = LayerNormLinear(arch.hidden_size, arch.qkv_rows, arch.rms_norm_eps, device, dtype)
        self.core_attention = CoreAttention(arch.num_attention_heads, window, device, dtype)
        self.linear_proj = Linear(
            arch.num_attention_heads * arch.head_dim, arch.hidden_size, bias=True, device=device, dtype=dtype
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: tuple[int, ...] | None = None) -> torch.Tensor:
        """x [B, S, H] (un-normalised: the norm is fused into linear_qkv) -> attention output [B, S, H];
        cu_seqlens: packed documents (see `document_attention`), None = one per row.

        Under context parallel, x, cos and sin are this rank's slice of S/CP positions of every row
        and cu_seqlens are those of the FULL rows: attention runs on whole rows for this rank's heads."""
        qkv = self.linear_qkv(x)
        # core_attn recompute: v is a view of qkv, so keeping q, k, v would keep qkv and the rotated
        # q and k; keeping qkv alone and recomputing the rotation is the smaller choice.
        out = (checkpointed(self._core, qkv, cos, sin, cu_seqlens) if self.core_attention.recompute
               else self._core(qkv, cos, sin, cu_seqlens))
        return self.project_out(out)

    def _core(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              cu_seqlens: tuple[int, ...] | None = None) -> torch.Tensor:
        """QKV output [B, S, rows] -> rotary embedding -> the core: [B, heads, S, head_dim]."""
        q, k, v = self._split_rotate(qkv, cos, sin)
        if self.cp_group is None:
            return self.core_attention(q, k, v, cu_seqlens)
        # context parallel: sequence slices -> head slices, attention on whole rows, and back
        q, k, v = (seq_to_heads(t, self.cp_group) for t in (q, k, v))
        out = self.core_attention(q, k, v, cu_seqlens, head_range(self.num_heads, self.cp_group))
        return heads_to_seq(out, self.cp_group)

    def _split_rotate(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """QKV output [B, S, rows] (rows grouped by kv head) -> q [B, heads, S, d] and k
        [B, kv_heads, S, d] rotated, v [B, kv_heads, S, d]."""
        b, s, _ = qkv.shape
        r = self.num_heads // self.num_kv_heads
        qkv = qkv.view(b, s, self.num_kv_heads, r + 2, self.head_dim)
        q = qkv[:, :, :, :r].reshape(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = qkv[:, :, :, r].transpose(1, 2)
        v = qkv[:, :, :, r + 1].transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    # --- the pieces of forward, for incremental decoding (model/kv_cache.py) ----------------
    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, S, H] -> q [B, heads, S, d], k and v [B, kv_heads, S, d], q and k rotated (as forward)."""
        return self._split_rotate(self.linear_qkv(x), cos, sin)

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output per head [B, heads, S, d] -> [B, S, H] (as forward)."""
        b, _, s, _ = out.shape
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class AttentionLayer(nn.Module):
    """A `*` layer of the Hybrid stack: x + Attn(RMSNorm(x))."""

    symbol = "*"

    def __init__(self, arch: GptOssArch, window: int | None, device=None, dtype=None):
        super().__init__()
        self.self_attention = SelfAttention(arch, window, device, dtype)

    def set_recompute(self, pieces: set[str]) -> None:
        """The selective recompute pieces of this layer (model/recompute.py): layernorm, core_attn."""
        self.self_attention.linear_qkv.recompute_norm = "layernorm" in pieces
        self.self_attention.core_attention.recompute = "core_attn" in pieces

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: tuple[int, ...] | None = None) -> torch.Tensor:
        return x + self.self_attention(x, cos, sin, cu_seqlens)
