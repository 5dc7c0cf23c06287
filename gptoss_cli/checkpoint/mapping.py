"""The HF <-> Hybrid mapping table: one entry per parameter family, with a pair of transforms.

The table is declarative and drives both directions (gpt-oss-reference.md section 4). HF names
here are *canonical*: every HF tensor as Hugging Face names it, except that the two expert weight
stacks are named `experts.gate_up` `[E, 2I, H]` and `experts.down` `[E, H, I]`, i.e. in
`[expert, out, in]` orientation with gate/up rows still interleaved. How those canonical tensors
are stored (bf16 `gate_up_proj [E, H, 2I]`, MXFP4 `*_blocks`/`*_scales`, OpenAI's `original/`
names) is the job of `formats/hf/layouts.py`; orientation there is keyed on the stored form, never on shapes.

Placeholders: `{i}` HF block, `{attn}` = 2i (attention layer), `{moe}` = 2i+1 (MoE layer),
`{e}` global expert id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from gptoss_cli.errors import CheckpointError
from gptoss_cli.model.config import GptOssArch

Tensors = Sequence[torch.Tensor]


# --- transforms -------------------------------------------------------------------------
def identity(arch: GptOssArch, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(ts)


# The transforms fill a new tensor by slices rather than calling torch.cat: `hybrid_shapes` runs them on
# meta tensors, and torch's first cat of meta tensors imports torch._dynamo (2-10 s, measured inside
# every `gptoss convert`), where a slice copy has a C++ meta kernel.
def fuse_qkv(arch: GptOssArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
    """Megatron's fused QKV: per kv group g, rows [q heads g*r .. g*r+r-1, k_g, v_g] (weights or biases)."""
    g, r, d = arch.num_key_value_heads, arch.q_per_kv, arch.head_dim
    rest = q.shape[1:]
    fused = q.new_empty((g, r + 2, d, *rest))
    fused[:, :r] = q.reshape(g, r, d, *rest)
    fused[:, r] = k.reshape(g, d, *rest)
    fused[:, r + 1] = v.reshape(g, d, *rest)
    return (fused.reshape(g * (r + 2) * d, *rest),)


def split_qkv(arch: GptOssArch, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, r, d = arch.num_key_value_heads, arch.q_per_kv, arch.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, r + 2, d, *rest)
    q = grouped[:, :r].reshape(g * r * d, *rest)
    k = grouped[:, r].reshape(g * d, *rest)
    v = grouped[:, r + 1].reshape(g * d, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def deinterleave_experts(arch: GptOssArch, stacked: torch.Tensor) -> list[torch.Tensor]:
    """`[n, 2I, ...]` with gate/up rows alternating (gate j = row 2j) -> n tensors `[gate; up]`."""
    half = stacked.shape[1] // 2
    fused = stacked.new_empty(stacked.shape)
    fused[:, :half] = stacked[:, 0::2]
    fused[:, half:] = stacked[:, 1::2]
    return list(fused.unbind(0))


def interleave_experts(arch: GptOssArch, per_expert: Tensors) -> torch.Tensor:
    stacked = torch.stack(list(per_expert))
    half = stacked.shape[1] // 2
    out = torch.empty_like(stacked)
    out[:, 0::2] = stacked[:, :half]
    out[:, 1::2] = stacked[:, half:]
    return out


def unstack_experts(arch: GptOssArch, stacked: torch.Tensor) -> list[torch.Tensor]:
    return list(stacked.unbind(0))


def stack_experts(arch: GptOssArch, per_expert: Tensors) -> torch.Tensor:
    return torch.stack(list(per_expert))


# --- the table ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Mapping:
    """HF names <-> Hybrid names for one parameter family.

    Ordinary entries map a tuple of HF tensors to a tuple of Hybrid tensors. `per_expert`
    entries map one HF stack `[E, ...]` to one Hybrid tensor per expert (`{e}` in the name); their
    transforms take a chunk of consecutive experts so that conversion never holds a whole stack.
    """

    hf: tuple[str, ...]
    hybrid: tuple[str, ...]
    to_hybrid: Callable
    to_hf: Callable
    scope: str = "block"  # "block" (per HF block) or "global"
    per_expert: bool = False


L = "model.layers.{i}."
A = "decoder.layers.{attn}."
M = "decoder.layers.{moe}."

TABLE: tuple[Mapping, ...] = (
    Mapping(("model.embed_tokens.weight",), ("embedding.word_embeddings.weight",), identity, identity, "global"),
    Mapping((L + "input_layernorm.weight",), (A + "self_attention.linear_qkv.layer_norm_weight",), identity, identity),
    Mapping(
        (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"),
        (A + "self_attention.linear_qkv.weight",),
        fuse_qkv,
        split_qkv,
    ),
    Mapping(
        (L + "self_attn.q_proj.bias", L + "self_attn.k_proj.bias", L + "self_attn.v_proj.bias"),
        (A + "self_attention.linear_qkv.bias",),
        fuse_qkv,
        split_qkv,
    ),
    Mapping((L + "self_attn.o_proj.weight",), (A + "self_attention.linear_proj.weight",), identity, identity),
    Mapping((L + "self_attn.o_proj.bias",), (A + "self_attention.linear_proj.bias",), identity, identity),
    Mapping((L + "self_attn.sinks",), (A + "self_attention.core_attention.softmax_offset",), identity, identity),
    Mapping((L + "post_attention_layernorm.weight",), (M + "pre_mlp_layernorm.weight",), identity, identity),
    Mapping((L + "mlp.router.weight",), (M + "mlp.router.weight",), identity, identity),
    Mapping((L + "mlp.router.bias",), (M + "mlp.router.bias",), identity, identity),
    Mapping(
        (L + "mlp.experts.gate_up",),
        (M + "mlp.experts.linear_fc1.weight{e}",),
        deinterleave_experts,
        interleave_experts,
        per_expert=True,
    ),
    Mapping(
        (L + "mlp.experts.gate_up_proj_bias",),
        (M + "mlp.experts.linear_fc1.bias{e}",),
        deinterleave_experts,
        interleave_experts,
        per_expert=True,
    ),
    Mapping(
        (L + "mlp.experts.down",),
        (M + "mlp.experts.linear_fc2.weight{e}",),
        unstack_experts,
        stack_experts,
        per_expert=True,
    ),
    Mapping(
        (L + "mlp.experts.down_proj_bias",),
        (M + "mlp.experts.linear_fc2.bias{e}",),
        unstack_experts,
        stack_experts,
        per_expert=True,
    ),
    Mapping(("model.norm.weight",), ("decoder.final_norm.weight",), identity, identity, "global"),
    Mapping(("lm_head.weight",), ("output_layer.weight",), identity, identity, "global"),
)

# Megatron pads these to a multiple of 128*TP rows; export strips the padding (section 4).
VOCAB_PADDED_HYBRID = ("embedding.word_embeddings.weight", "output_layer.weight")
VOCAB_PAD_MULTIPLE = 128  # Megatron's make_vocab_size_divisible_by default


def is_vocab_padding(rows: int, arch: GptOssArch) -> bool:
    """Whether `rows` stored rows are `arch.vocab_size` as Megatron pads it: the next multiple of
    128 x TP, for a tensor-parallel size TP that divides the attention heads
    (docs/checkpoint-layouts.md, "Vocabulary padding").

    Anything else (fewer rows, or more than that padding) means the config's vocab_size does not
    describe the tensors, and cutting the rows would silently drop real tokens.
    """
    vocab = arch.vocab_size
    if rows == vocab:
        return True
    for tp in range(1, arch.num_attention_heads + 1):
        m = VOCAB_PAD_MULTIPLE * tp
        if arch.num_attention_heads % tp == 0 and -(-vocab // m) * m == rows:
            return True
    return False


def check_vocab_padding(rows: int, arch: GptOssArch, file: object, name: str) -> None:
    """CheckpointError unless the `rows` stored rows of vocabulary tensor `name` (in `file`) are
    vocab_size or Megatron's padding of it (`is_vocab_padding`)."""
    if is_vocab_padding(rows, arch):
        return
    raise CheckpointError(
        f"{file}: tensor {name!r} has {rows} rows but vocab_size is {arch.vocab_size}; extra rows are allowed only "
        f"as Megatron's padding to the next multiple of 128 x TP (TP dividing "
        f"num_attention_heads={arch.num_attention_heads})",
        hint="fix vocab_size in the config: cutting the rows would drop real tokens",
    )


def canonical_hf_shapes(arch: GptOssArch) -> dict[str, tuple[int, ...]]:
    """Every canonical HF tensor and its shape for `arch` (the expected source/target tensors)."""
    H, I, E = arch.hidden_size, arch.intermediate_size, arch.num_local_experts
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, H)}
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (q, H),
                p + "self_attn.k_proj.weight": (kv, H),
                p + "self_attn.v_proj.weight": (kv, H),
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (H, q),
                p + "self_attn.o_proj.bias": (H,),
                p + "self_attn.sinks": (arch.num_attention_heads,),
                p + "post_attention_layernorm.weight": (H,),
                p + "mlp.router.weight": (E, H),
                p + "mlp.router.bias": (E,),
                p + "mlp.experts.gate_up": (E, 2 * I, H),
                p + "mlp.experts.gate_up_proj_bias": (E, 2 * I),
                p + "mlp.experts.down": (E, H, I),
                p + "mlp.experts.down_proj_bias": (E, H),
            }
        )
    shapes["model.norm.weight"] = (H,)
    shapes["lm_head.weight"] = (arch.vocab_size, H)
    return shapes


# --- instantiating the table for a model -------------------------------------------------
@dataclass(frozen=True)
class Unit:
    """One table entry bound to one HF block (or the globals): concrete names on both sides."""

    mapping: Mapping
    block: int | None
    hf: tuple[str, ...]
    hybrid: tuple[str, ...]  # for per-expert entries: one name per expert, in expert order

    @property
    def per_expert(self) -> bool:
        return self.mapping.per_expert

    def to_hybrid(self, arch: GptOssArch, hf: Tensors) -> list[torch.Tensor]:
        if self.per_expert:
            return list(self.mapping.to_hybrid(arch, hf[0]))
        return list(self.mapping.to_hybrid(arch, *hf))

    def to_hf(self, arch: GptOssArch, hybrid: Tensors) -> list[torch.Tensor]:
        if self.per_expert:
            return [self.mapping.to_hf(arch, hybrid)]
        return list(self.mapping.to_hf(arch, *hybrid))


def _fill(template: str, block: int | None, expert: int | None = None) -> str:
    kw = {}
    if block is not None:
        kw.update(i=block, attn=2 * block, moe=2 * block + 1)
    if expert is not None:
        kw["e"] = expert
    return template.format(**kw)


def units(arch: GptOssArch, blocks: Sequence[int] | None = None, *, globals_: bool = True) -> list[Unit]:
    """The table bound to a model, in output order: embedding, blocks in order, final norm, head."""
    blocks = range(arch.num_hidden_layers) if blocks is None else blocks
    out: list[Unit] = []

    def bind(m: Mapping, block: int | None) -> Unit:
        hf = tuple(_fill(t, block) for t in m.hf)
        if m.per_expert:
            hybrid = tuple(_fill(m.hybrid[0], block, e) for e in range(arch.num_local_experts))
        else:
            hybrid = tuple(_fill(t, block) for t in m.hybrid)
        return Unit(m, block, hf, hybrid)

    head = [m for m in TABLE if m.scope == "global"]
    if globals_:
        out.append(bind(head[0], None))
    for b in blocks:
        out.extend(bind(m, b) for m in TABLE if m.scope == "block")
    if globals_:
        out.extend(bind(m, None) for m in head[1:])
    return out


def hybrid_shapes(arch: GptOssArch) -> dict[str, tuple[int, ...]]:
    """Every Hybrid tensor and its shape, derived by running the table on meta tensors."""
    canon = canonical_hf_shapes(arch)
    shapes: dict[str, tuple[int, ...]] = {}
    for unit in units(arch):
        ins = [torch.empty(canon[n], device="meta") for n in unit.hf]
        for name, t in zip(unit.hybrid, unit.to_hybrid(arch, ins)):
            shapes[name] = tuple(t.shape)
    return shapes
