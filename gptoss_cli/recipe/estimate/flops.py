"""Model FLOPs per token and MFU: the one definition validate-config, train and the benches report.

Training FLOPs per token (forward + backward; docs/flops.md derives the 20B and 120B numbers):

    6 x the active matmul parameters of one token
        attention: QKV (H x (heads + 2 kv heads) x head_dim) and output projection (heads x head_dim x H);
        MoE: router (H x E) and the top-k experts' fc1 (H x 2I) and fc2 (I x H); dense MLP: fc1 + fc2;
        the LM head (V x H); not the embedding lookup, norms, biases or sinks;
  + 12 x heads x head_dim x the keys each query attends, per attention layer, averaged over the
        positions of a sequence (causal: (S + 1) / 2; a sliding window W: min(position + 1, W)).

Each symbol of the hybrid pattern is counted once: an HF block is one `*` and one `E` layer, so the
`*E` split neither doubles nor halves it (Megatron-Bridge's hybrid layout once reported doubled
TFLOP/s by counting every physical layer as a whole transformer block).

Recompute does not change model FLOPs; `recompute_flops_per_token` is the extra forward work it
does (hardware FLOPs = model FLOPs + recompute FLOPs). Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.pattern import ATTENTION, MLP, MOE, HybridPattern, default_pattern

# Dense (no sparsity) peak tensor throughput of one GPU, TFLOP/s, from the vendors' data sheets:
# (bf16, fp8). A100 has no FP8 tensor cores. MXFP8 runs at the FP8 rate.
PEAK_TFLOPS: dict[str, tuple[float, float | None]] = {
    "a100": (312.0, None),
    "h100": (989.0, 1979.0),  # SXM
    "h200": (989.0, 1979.0),
    "b200": (2250.0, 4500.0),
    "gb200": (2500.0, 5000.0),
    "gb300": (2500.0, 5000.0),
}


def peak_tflops(gpu: str | None, fp8: bool) -> float | None:
    """The dense peak of `gpu` (a system.gpu value) for the GEMMs' precision; None when unknown
    (auto, none, a CPU, FP8 on a GPU without FP8)."""
    row = PEAK_TFLOPS.get(gpu or "")
    if row is None:
        return None
    return row[1] if fp8 else row[0]


def average_keys_per_query(seq_length: int, window: int | None) -> float:
    """Keys a query sees, averaged over positions 0..S-1: causal, or at most `window` (itself included)."""
    s = int(seq_length)
    if s <= 0:
        return 0.0
    if window is None or window >= s:
        return (s + 1) / 2
    w = int(window)
    return (w * (w + 1) / 2 + (s - w) * w) / s


@dataclass(frozen=True)
class FlopCount:
    """Training FLOPs per token of one model at one sequence length, split by where they go."""

    matmul_params: int  # active matmul parameters per token (6x of them are the GEMM FLOPs)
    attention: float  # 12 x heads x head_dim x keys, summed over attention layers
    attention_layers: tuple[float, ...]  # forward FLOPs of each attention layer's core (4 x ... x keys)

    @property
    def model_flops_per_token(self) -> float:
        return 6.0 * self.matmul_params + self.attention


def layer_matmul_params(arch: GptOssArch, symbol: str) -> int:
    """Active matmul parameters per token of one physical layer of kind `symbol`."""
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    if symbol == ATTENTION:
        return h * (arch.num_attention_heads + 2 * arch.num_key_value_heads) * d + arch.num_attention_heads * d * h
    if symbol == MOE:
        return h * arch.num_local_experts + arch.num_experts_per_tok * 3 * h * i
    if symbol == MLP:
        return 3 * h * i
    return 0


def count_flops(arch: GptOssArch, seq_length: int, pattern: HybridPattern | None = None) -> FlopCount:
    """FLOPs per token of `arch` in `pattern` (default: its `*E` layout) on sequences of `seq_length`."""
    pattern = pattern or default_pattern(arch)
    params = arch.vocab_size * arch.hidden_size  # the LM head
    attention: list[float] = []
    block = 0
    for symbol in pattern.layers:
        params += layer_matmul_params(arch, symbol)
        if symbol == ATTENTION:
            window = arch.sliding_window if arch.is_sliding(block) else None
            keys = average_keys_per_query(seq_length, window)
            attention.append(4.0 * arch.num_attention_heads * arch.head_dim * keys)
            block += 1
    return FlopCount(matmul_params=params, attention=3.0 * sum(attention), attention_layers=tuple(attention))


def model_flops_per_token(arch: GptOssArch, seq_length: int, pattern: HybridPattern | None = None) -> float:
    """Training (forward + backward) model FLOPs per token; see the module docstring."""
    return count_flops(arch, seq_length, pattern).model_flops_per_token


def recompute_flops_per_token(arch: GptOssArch, seq_length: int, pattern: HybridPattern | None,
                              layers: dict[int, set[str]]) -> float:
    """The forward work recompute repeats per token: for each physical layer j, `layers[j]` names
    what it recomputes ("layer": all of it; "core_attn", "moe", "mlp": that piece; elementwise
    pieces such as "moe_act" and "layernorm" count as no FLOPs)."""
    pattern = pattern or default_pattern(arch)
    count = count_flops(arch, seq_length, pattern)
    h, i, k = arch.hidden_size, arch.intermediate_size, arch.num_experts_per_tok
    total = 0.0
    attn = iter(count.attention_layers)
    for j, symbol in enumerate(pattern.layers):
        core = next(attn) if symbol == ATTENTION else 0.0
        what = layers.get(j, set())
        if "layer" in what:
            total += 2.0 * layer_matmul_params(arch, symbol) + core
            continue
        if symbol == ATTENTION and "core_attn" in what:
            total += core
        if symbol == MOE and "moe" in what:
            total += 2.0 * k * 3 * h * i
        if symbol == MLP and "mlp" in what:
            total += 2.0 * 3 * h * i
    return total


def pipeline_op_flops(arch: GptOssArch, seq_length: int, pattern: HybridPattern | None = None
                      ) -> tuple[float, float, float]:
    """(forward, backward for inputs, deferred weight gradients) model FLOPs per token, what a pipeline
    schedule's F, I and W actions compute (gptoss_cli/schedule/pipeline/: W is the experts' weight-gradient
    GEMMs, the rest of the backward runs in I): forward = a third of the training FLOPs, backward
    twice the forward, W = 2 x the experts' active matmul parameters."""
    pattern = pattern or default_pattern(arch)
    forward = model_flops_per_token(arch, seq_length, pattern) / 3.0
    w = 2.0 * pattern.layers.count(MOE) * arch.num_experts_per_tok * 3 * arch.hidden_size * arch.intermediate_size
    return forward, 2.0 * forward - w, w


def throughput(flops_per_token: float, tokens_per_s: float, world_size: int, peak: float | None
               ) -> tuple[float, float | None]:
    """(TFLOP/s per GPU, MFU as a fraction or None without a known peak) of a job processing
    `tokens_per_s` tokens per second over `world_size` GPUs."""
    tflops = flops_per_token * tokens_per_s / max(1, world_size) / 1e12
    return tflops, (tflops / peak if peak else None)


__all__ = ["PEAK_TFLOPS", "peak_tflops", "average_keys_per_query", "FlopCount", "count_flops", "layer_matmul_params",
           "model_flops_per_token", "recompute_flops_per_token", "pipeline_op_flops", "throughput"]
