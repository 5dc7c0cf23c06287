"""GGUF tensor names for llama.cpp's `gpt-oss` architecture, from the canonical HF names (checkpoint/mapping.py).
Torch-free.

llama.cpp's loader (src/models/openai-moe.cpp) creates these tensors by name, with ggml's dimension order
(innermost first); listed here in numpy's order (outermost first), which is the HF order:

    token_embd.weight               [V, H]       model.embed_tokens.weight
    blk.{i}.attn_norm.weight        [H]          input_layernorm.weight
    blk.{i}.attn_{q,k,v}.weight     [rows, H]    self_attn.{q,k,v}_proj.weight (and .bias)
    blk.{i}.attn_output.weight      [H, q]       self_attn.o_proj.weight (and .bias)
    blk.{i}.attn_sinks.weight       [heads]      self_attn.sinks
    blk.{i}.post_attention_norm.weight [H]       post_attention_layernorm.weight
    blk.{i}.ffn_gate_inp.weight     [E, H]       mlp.router.weight (and .bias)
    blk.{i}.ffn_gate_exps.weight    [E, I, H]    the gate rows of experts.gate_up (even rows: gate/up interleave)
    blk.{i}.ffn_up_exps.weight      [E, I, H]    its up rows (odd rows)
    blk.{i}.ffn_down_exps.weight    [E, H, I]    experts.down
    blk.{i}.ffn_{gate,up}_exps.bias [E, I]       gate_up_proj_bias, even / odd columns
    blk.{i}.ffn_down_exps.bias      [E, H]       down_proj_bias
    output_norm.weight              [H]          model.norm.weight
    output.weight                   [V, H]       lm_head.weight

Every weight is [out, in] as HF stores the non-expert ones, so nothing is transposed; the experts are the
canonical output-major stacks split into gate and up. What type each is written in (`TensorRole`) follows
llama.cpp's own converter: norms, biases, sinks and the router in F32 always, the expert weights in the
experts' type, the other matrices in --dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

ARCH = "gpt-oss"
# the roles of a tensor, each written in one type: --dtype, the experts' type, or always F32
MAIN, EXPERTS, F32 = "main", "experts", "f32"
GATE, UP, WHOLE = "gate", "up", "whole"  # which rows of the canonical tensor a GGUF tensor takes


@dataclass(frozen=True)
class GgufTensor:
    """One GGUF tensor: its name, the canonical HF tensor it comes from, which part of it, its role."""

    name: str
    canonical: str
    part: str  # WHOLE, or GATE / UP: the even / odd rows (weights) or columns (biases) of a gate_up stack
    role: str  # MAIN, EXPERTS or F32


_BLOCK = (  # (canonical suffix after model.layers.{i}., GGUF suffix after blk.{i}., part, role)
    ("input_layernorm.weight", "attn_norm.weight", WHOLE, F32),
    ("self_attn.q_proj.weight", "attn_q.weight", WHOLE, MAIN),
    ("self_attn.k_proj.weight", "attn_k.weight", WHOLE, MAIN),
    ("self_attn.v_proj.weight", "attn_v.weight", WHOLE, MAIN),
    ("self_attn.q_proj.bias", "attn_q.bias", WHOLE, F32),
    ("self_attn.k_proj.bias", "attn_k.bias", WHOLE, F32),
    ("self_attn.v_proj.bias", "attn_v.bias", WHOLE, F32),
    ("self_attn.o_proj.weight", "attn_output.weight", WHOLE, MAIN),
    ("self_attn.o_proj.bias", "attn_output.bias", WHOLE, F32),
    ("self_attn.sinks", "attn_sinks.weight", WHOLE, F32),
    ("post_attention_layernorm.weight", "post_attention_norm.weight", WHOLE, F32),
    ("mlp.router.weight", "ffn_gate_inp.weight", WHOLE, F32),
    ("mlp.router.bias", "ffn_gate_inp.bias", WHOLE, F32),
    ("mlp.experts.gate_up", "ffn_gate_exps.weight", GATE, EXPERTS),
    ("mlp.experts.gate_up", "ffn_up_exps.weight", UP, EXPERTS),
    ("mlp.experts.gate_up_proj_bias", "ffn_gate_exps.bias", GATE, F32),
    ("mlp.experts.gate_up_proj_bias", "ffn_up_exps.bias", UP, F32),
    ("mlp.experts.down", "ffn_down_exps.weight", WHOLE, EXPERTS),
    ("mlp.experts.down_proj_bias", "ffn_down_exps.bias", WHOLE, F32),
)
_GLOBAL = {
    "model.embed_tokens.weight": GgufTensor("token_embd.weight", "model.embed_tokens.weight", WHOLE, MAIN),
    "model.norm.weight": GgufTensor("output_norm.weight", "model.norm.weight", WHOLE, F32),
    "lm_head.weight": GgufTensor("output.weight", "lm_head.weight", WHOLE, MAIN),
}


def gguf_tensors(canonical: str) -> list[GgufTensor]:
    """The GGUF tensors made from canonical HF tensor `canonical` (two for a gate_up stack)."""
    if canonical in _GLOBAL:
        return [_GLOBAL[canonical]]
    prefix, _, rest = canonical.partition(".layers.")
    block, _, suffix = rest.partition(".")
    if prefix != "model" or not block.isdigit():
        raise KeyError(canonical)
    found = [GgufTensor(f"blk.{block}.{name}", canonical, part, role) for c, name, part, role in _BLOCK if c == suffix]
    if not found:
        raise KeyError(canonical)
    return found


def all_names(num_layers: int) -> list[str]:
    """Every GGUF tensor name llama.cpp's gpt-oss loader reads for a model of `num_layers` blocks."""
    return ([t.name for t in _GLOBAL.values()]
            + [f"blk.{i}.{name}" for i in range(num_layers) for _, name, _, _ in _BLOCK])


__all__ = ["ARCH", "MAIN", "EXPERTS", "F32", "GATE", "UP", "WHOLE", "GgufTensor", "gguf_tensors", "all_names"]
