"""GQA self-attention with learned sinks, sliding windows, YaRN RoPE and biases (reference section 2).

Layout follows Megatron's Hybrid attention layer so that parameter names are the checkpoint's:
`self_attention.linear_qkv.{layer_norm_weight,weight,bias}` (the input RMSNorm fused into the QKV
projection, as Transformer Engine's LayerNormLinear does), `self_attention.core_attention.
softmax_offset` (the sinks) and `self_attention.linear_proj.{weight,bias}`.

The fused QKV rows are grouped by kv head (section 4): for kv group g, the r = heads/kv query
heads g*r .. g*r+r-1, then k_g, then v_g.

Sinks are what section 2 says they are: one extra softmax column per query head whose value is
zero. The core (`CoreAttention`) computes them with the kernel `model.attention_backend` chooses per
device and layer (model/attention/backends.py: the flash kernels' log-sum-exp, FlexAttention, or SDPA
with the sink as a padded extra key).
"""

from __future__ import annotations

import torch
from torch import nn

from gptoss_cli.model.attention.backends import check_backend, document_attention
from gptoss_cli.model.catalog import ATTENTION_BACKEND_DEFAULT
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.context_parallel import head_range, heads_to_seq, seq_to_heads
from gptoss_cli.model.gemm.dense import DenseAdapter, DenseGemm, Linear, attached_adapter, linear
from gptoss_cli.model.norm import rms_norm
from gptoss_cli.model.recompute import checkpointed, without_output
from gptoss_cli.model.rope import apply_rotary


class LayerNormLinear(nn.Module):
    """RMSNorm fused with a linear projection: Megatron's `linear_qkv` with `layer_norm_weight`.

    The norm stays in high precision; the projection's GEMMs are `gemm`'s (model/gemm/dense.py); an adapter
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
    backend = ATTENTION_BACKEND_DEFAULT  # model.attention_backend (model/attention/backends.py); set_backend

    def __init__(self, num_heads: int, window: int | None, device=None, dtype=None):
        super().__init__()
        self.window = window
        self.softmax_offset = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens: tuple[int, ...] | None = None, heads: slice | None = None) -> torch.Tensor:
        """`heads`: the query heads q holds (context parallel: this rank's chunk), default all."""
        sinks = self.softmax_offset if heads is None else self.softmax_offset[heads]
        return document_attention(q, k, v, sinks, self.window, cu_seqlens, self.backend)

    def set_backend(self, name: str) -> None:
        """Which kernel computes this layer (model.attention_backend: auto, flash, flex, sdpa)."""
        self.backend = check_backend(name)

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

    # --- the pieces of forward, for incremental decoding (model/decode/kv_cache.py) ----------------
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
