"""How canonical HF tensors are stored: bf16 experts, MXFP4 experts, and OpenAI's `original/` names.

A layout maps each canonical tensor (see checkpoint/mapping.py) to the tensor(s) a checkpoint stores and
back. Expert orientation is a property of the stored form (docs/checkpoint-layouts.md, "Hugging Face layout"):
bf16 `gate_up_proj` is `[E, H, 2I]` (input-major, used as `x @ W`), MXFP4 blocks are `[E, 2I, ...]`
(output-major). It is never inferred from shapes, which are square for the real models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from gptoss_cli.checkpoint.mapping import canonical_hf_shapes
from gptoss_cli.checkpoint.storage.readers import RowReader
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.mxfp4 import codec as mxfp4

FLOAT = "float"
UINT8 = "uint8"
Shape = tuple[int, ...]
EXPERT_CHUNK = 8  # experts read per chunk from an HF stack (model loading, parity's weight check)


@dataclass(frozen=True)
class Codec:
    """Canonical tensor <-> stored tensor(s). `rows` selects a row range of a fused stored tensor."""

    stored: tuple[str, ...]
    load: Callable[..., torch.Tensor]
    store: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None
    shapes: Callable[[Shape], tuple[Shape, ...]]
    kinds: tuple[str, ...] = (FLOAT,)
    rows: Callable[[GptOssArch], tuple[int, int]] | None = None
    # `load` turns each row (dims 0 and 1) of the stored tensors into the same row of the result,
    # on its own (MXFP4 decode): moving or splitting rows commutes with it, so conversion moves the
    # stored bytes (a quarter of the bf16 values' size) instead of the loaded values; its `load`
    # also takes `out=`, a tensor of the result's shape and dtype to write the result into.
    rowwise: bool = False


def _same(shape: Shape) -> tuple[Shape]:
    return (shape,)


def _transposed(shape: Shape) -> tuple[Shape]:
    return ((shape[0], shape[2], shape[1]),)


def _mx_shapes(shape: Shape) -> tuple[Shape, Shape]:
    e, out, inp = shape
    return (e, out, inp // mxfp4.GROUP, mxfp4.GROUP // 2), (e, out, inp // mxfp4.GROUP)


def _mx_load(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    return mxfp4.decode(blocks, scales, dtype, out=out)


def _bf16_load(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.transpose(1, 2).to(dtype)


def _bf16_store(t: torch.Tensor) -> tuple[torch.Tensor]:
    return (t.transpose(1, 2).contiguous(),)


def _plain_load(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype)


@dataclass(frozen=True)
class Layout:
    """A stored layout: codecs for the canonical names that are stored differently; identity otherwise."""

    name: str
    experts_form: str  # "bf16" or "mxfp4"
    codecs: dict[str, Codec] = field(default_factory=dict)  # keyed by canonical template with {i}
    # canonical template -> stored template, for layouts that rename plain tensors (original/)
    renames: dict[str, str] = field(default_factory=dict)

    def _codec(self, canonical: str) -> tuple[Codec, dict[str, str]]:
        template, kw = _template_of(canonical)
        codec = self.codecs.get(template)
        if codec is None:
            stored = self.renames.get(template, template)
            codec = Codec(stored=(stored,), load=_plain_load, store=lambda t: (t,), shapes=_same)
        return codec, kw

    def stored_names(self, canonical: str) -> tuple[str, ...]:
        codec, kw = self._codec(canonical)
        return tuple(s.format(**kw) for s in codec.stored)

    def stored_specs(self, arch: GptOssArch) -> dict[str, tuple[Shape, str]]:
        """Every stored tensor this layout expects for `arch`: name -> (shape, kind)."""
        specs: dict[str, tuple[Shape, str]] = {}
        for canonical, shape in canonical_hf_shapes(arch).items():
            codec, kw = self._codec(canonical)
            if codec.rows is not None:  # a row range of a fused tensor: the fused shape is declared below
                continue
            for s, shp, kind in zip(codec.stored, codec.shapes(shape), codec.kinds):
                specs[s.format(**kw)] = (shp, kind)
        specs.update(self.fused_specs(arch))
        return specs

    def fused_specs(self, arch: GptOssArch) -> dict[str, tuple[Shape, str]]:
        return {}

    def read(
        self,
        reader: RowReader,
        arch: GptOssArch,
        canonical: str,
        dtype: torch.dtype,
        start: int | None = None,
        stop: int | None = None,
    ) -> torch.Tensor:
        """Read canonical tensor `canonical` (rows [start, stop) of dim 0 for expert stacks) as `dtype`."""
        codec, kw = self._codec(canonical)
        names = [s.format(**kw) for s in codec.stored]
        if codec.rows is not None:
            r0, r1 = codec.rows(arch)
            return codec.load(reader.read(names[0], r0, r1), dtype)
        return codec.load(*[reader.read(n, start, stop) for n in names], dtype)

    def read_rowwise(self, reader: RowReader, canonical: str, start: int, stop: int) -> list[torch.Tensor] | None:
        """Rows [start, stop) of the stored tensors of `canonical`, not loaded, if its codec is
        row-wise (see `Codec.rowwise`); None if it is not. Pass them, rows moved alike, to `load`."""
        codec, kw = self._codec(canonical)
        if not codec.rowwise:
            return None
        return [reader.read(s.format(**kw), start, stop) for s in codec.stored]

    def load(self, canonical: str, stored: list[torch.Tensor], dtype: torch.dtype,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Stored rows from `read_rowwise` -> the canonical rows in `dtype`, written into `out` if given."""
        codec, _ = self._codec(canonical)
        return codec.load(*stored, dtype, out=out)

    def store(self, canonical: str, chunk: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        codec, kw = self._codec(canonical)
        if codec.store is None:
            raise ValueError(f"layout {self.name} is read-only for {canonical}")
        return [(s.format(**kw), t) for s, t in zip(codec.stored, codec.store(chunk))]


_PLACEHOLDER = re.compile(r"^model\.layers\.(\d+)\.")


def _template_of(canonical: str) -> tuple[str, dict[str, str]]:
    m = _PLACEHOLDER.match(canonical)
    if not m:
        return canonical, {}
    return "model.layers.{i}." + canonical[m.end():], {"i": m.group(1)}


EXP = "model.layers.{i}.mlp.experts."

HF_BF16 = Layout(
    name="hf",
    experts_form="bf16",
    codecs={
        EXP + "gate_up": Codec((EXP + "gate_up_proj",), _bf16_load, _bf16_store, _transposed),
        EXP + "down": Codec((EXP + "down_proj",), _bf16_load, _bf16_store, _transposed),
    },
)

HF_MXFP4 = Layout(
    name="hf",
    experts_form="mxfp4",
    codecs={
        EXP + "gate_up": Codec(
            (EXP + "gate_up_proj_blocks", EXP + "gate_up_proj_scales"), _mx_load, mxfp4.encode, _mx_shapes, (UINT8, UINT8),
            rowwise=True,
        ),
        EXP + "down": Codec(
            (EXP + "down_proj_blocks", EXP + "down_proj_scales"), _mx_load, mxfp4.encode, _mx_shapes, (UINT8, UINT8),
            rowwise=True,
        ),
    },
)


# --- OpenAI's original/ layout (a source only) ------------------------------------------
B = "block.{i}."
_ORIG_RENAMES = {
    "model.embed_tokens.weight": "embedding.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "unembedding.weight",
    "model.layers.{i}.input_layernorm.weight": B + "attn.norm.scale",
    "model.layers.{i}.self_attn.o_proj.weight": B + "attn.out.weight",
    "model.layers.{i}.self_attn.o_proj.bias": B + "attn.out.bias",
    "model.layers.{i}.self_attn.sinks": B + "attn.sinks",
    "model.layers.{i}.post_attention_layernorm.weight": B + "mlp.norm.scale",
    "model.layers.{i}.mlp.router.weight": B + "mlp.gate.weight",
    "model.layers.{i}.mlp.router.bias": B + "mlp.gate.bias",
    EXP + "gate_up_proj_bias": B + "mlp.mlp1_bias",
    EXP + "down_proj_bias": B + "mlp.mlp2_bias",
}


def _qkv_rows(part: str) -> Callable[[GptOssArch], tuple[int, int]]:
    """The original layout fuses q|k|v in plain order (not Megatron's per-group order)."""

    def rows(arch: GptOssArch) -> tuple[int, int]:
        q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
        return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[part]

    return rows


class _OriginalLayout(Layout):
    def fused_specs(self, arch: GptOssArch) -> dict[str, tuple[Shape, str]]:
        rows = arch.qkv_rows
        out = {}
        for i in range(arch.num_hidden_layers):
            out[f"block.{i}.attn.qkv.weight"] = ((rows, arch.hidden_size), FLOAT)
            out[f"block.{i}.attn.qkv.bias"] = ((rows,), FLOAT)
        return out


_orig_codecs = {
    EXP + "gate_up": Codec(
        (B + "mlp.mlp1_weight.blocks", B + "mlp.mlp1_weight.scales"), _mx_load, None, _mx_shapes, (UINT8, UINT8),
        rowwise=True,
    ),
    EXP + "down": Codec(
        (B + "mlp.mlp2_weight.blocks", B + "mlp.mlp2_weight.scales"), _mx_load, None, _mx_shapes, (UINT8, UINT8),
        rowwise=True,
    ),
}
for _part in ("q", "k", "v"):
    for _kind in ("weight", "bias"):
        _orig_codecs[f"model.layers.{{i}}.self_attn.{_part}_proj.{_kind}"] = Codec(
            (B + f"attn.qkv.{_kind}",), _plain_load, None, _same, rows=_qkv_rows(_part)
        )

OPENAI_ORIGINAL = _OriginalLayout(
    name="openai-original", experts_form="mxfp4", codecs=_orig_codecs, renames=_ORIG_RENAMES
)

HF_LAYOUTS = {"bf16": HF_BF16, "mxfp4": HF_MXFP4}
