"""What one rank's parameters are and how large its gradient buffers are: the parameter side of the
memory estimate (gptoss_cli/recipe/estimate/memory.py), pure Python.

`parameter_layout` lists a rank's parameters in `HybridModel.named_parameters()` order (its slice of
the experts; a pipeline rank's layers, embedding and head only), `lora_layout` its LoRA adapters,
`buffer_numel` the elements and buckets of a gradient buffer holding them (the layout of
gptoss_cli/parallel/grads.py's GradBuffer).
"""

from __future__ import annotations

from dataclasses import dataclass

from gptoss_cli.buckets import ALIGN
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.pattern import ATTENTION, MLP, MOE, HybridPattern


# --- parameters -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamSpec:
    name: str
    numel: int
    expert: bool  # reduced over expert-DP (a slice of the experts), else over DP


def parameter_layout(arch: GptOssArch, pattern: HybridPattern, num_local_experts: int | None = None, *,
                     layers: set[int] | None = None, embedding: bool = True, head: bool = True) -> list[ParamSpec]:
    """One rank's parameters in `HybridModel.named_parameters()` order, with its `num_local_experts`
    experts per MoE layer (default: all); a pipeline rank's: only `layers`, the embedding and the
    final norm and output layer when it holds them."""
    h, i, e = arch.hidden_size, arch.intermediate_size, arch.num_local_experts
    e_loc = e if num_local_experts is None else num_local_experts
    attn_width = arch.num_attention_heads * arch.head_dim
    out = [ParamSpec("embedding.word_embeddings.weight", arch.vocab_size * h, False)] if embedding else []
    for j, symbol in enumerate(pattern.layers):
        if layers is not None and j not in layers:
            continue
        p = f"decoder.layers.{j}."
        if symbol == ATTENTION:
            out += [ParamSpec(p + "self_attention.linear_qkv.layer_norm_weight", h, False),
                    ParamSpec(p + "self_attention.linear_qkv.weight", arch.qkv_rows * h, False),
                    ParamSpec(p + "self_attention.linear_qkv.bias", arch.qkv_rows, False),
                    ParamSpec(p + "self_attention.core_attention.softmax_offset", arch.num_attention_heads, False),
                    ParamSpec(p + "self_attention.linear_proj.weight", h * attn_width, False),
                    ParamSpec(p + "self_attention.linear_proj.bias", h, False)]
        elif symbol == MOE:
            out += [ParamSpec(p + "pre_mlp_layernorm.weight", h, False),
                    ParamSpec(p + "mlp.router.weight", e * h, False),
                    ParamSpec(p + "mlp.router.bias", e, False),
                    ParamSpec(p + "mlp.experts.linear_fc1.weight", e_loc * 2 * i * h, True),
                    ParamSpec(p + "mlp.experts.linear_fc1.bias", e_loc * 2 * i, True),
                    ParamSpec(p + "mlp.experts.linear_fc2.weight", e_loc * h * i, True),
                    ParamSpec(p + "mlp.experts.linear_fc2.bias", e_loc * h, True)]
        elif symbol == MLP:
            out += [ParamSpec(p + "pre_mlp_layernorm.weight", h, False),
                    ParamSpec(p + "mlp.linear_fc1.weight", 2 * i * h, False),
                    ParamSpec(p + "mlp.linear_fc1.bias", 2 * i, False),
                    ParamSpec(p + "mlp.linear_fc2.weight", h * i, False),
                    ParamSpec(p + "mlp.linear_fc2.bias", h, False)]
    if head:
        out += [ParamSpec("decoder.final_norm.weight", h, False),
                ParamSpec("output_layer.weight", arch.vocab_size * h, False)]
    return out


def lora_layout(arch: GptOssArch, pattern: HybridPattern, rank: int, targets: list[str] | tuple[str, ...],
                num_local_experts: int | None = None, layers: set[int] | None = None) -> list[ParamSpec]:
    """One rank's LoRA adapters (gptoss_cli/model/lora.py) in `named_parameters()` order: A [rank, in] and
    B [out, rank] per targeted layer, one pair per local expert on the experts."""
    h, i = arch.hidden_size, arch.intermediate_size
    e_loc = arch.num_local_experts if num_local_experts is None else num_local_experts
    attn_width = arch.num_attention_heads * arch.head_dim
    shapes = {ATTENTION: {"linear_qkv": (h, arch.qkv_rows), "linear_proj": (attn_width, h)},
              MOE: {"linear_fc1": (h, 2 * i), "linear_fc2": (i, h)}, MLP: {"linear_fc1": (h, 2 * i), "linear_fc2": (i, h)}}
    where = {ATTENTION: "self_attention.", MOE: "mlp.experts.", MLP: "mlp."}
    out = []
    for j, symbol in enumerate(pattern.layers):
        if layers is not None and j not in layers:
            continue
        copies = e_loc if symbol == MOE else 1
        for name, (fan_in, fan_out) in shapes.get(symbol, {}).items():
            if name in targets:
                p = f"decoder.layers.{j}.{where[symbol]}{name}.adapter."
                out += [ParamSpec(p + "linear_in.weight", copies * rank * fan_in, symbol == MOE),
                        ParamSpec(p + "linear_out.weight", copies * fan_out * rank, symbol == MOE)]
    return out


def buffer_numel(numels: list[int], shards: int, bucket_size: int) -> tuple[int, int]:
    """(elements, buckets) of a gradient buffer holding parameters of these sizes (in model order):
    reverse order, a bucket closes once it holds >= bucket_size elements, each padded to a
    multiple of ALIGN x shards (the layout of gptoss_cli/parallel/grads.py's GradBuffer)."""
    total = buckets = 0
    current = 0
    for k, n in enumerate(reversed(numels)):
        current += n
        if current >= bucket_size or k == len(numels) - 1:
            total += -(-current // (ALIGN * shards)) * ALIGN * shards
            buckets += 1
            current = 0
    return total, buckets


__all__ = ["ParamSpec", "parameter_layout", "lora_layout", "buffer_numel"]
