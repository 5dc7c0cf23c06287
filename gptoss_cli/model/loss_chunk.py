"""How many tokens the chunked LM head + loss takes at a time, per device (torch-free: the memory estimate reads it too).

Per token of a chunk the head holds its logits in the activation dtype, their fp32 copy for the loss
and the loss's fp32 gradient (b + 12 bytes x vocabulary, recipe/estimate/memory.py's "logits"). On
the CPU the chunk is at most 256 tokens (a chunk of a 20k vocabulary stays in cache, 11% faster in
bench/train.py), and its buffers are kept and reused from chunk to chunk and step to step
(model/workspace.py): two fp32 rows per token, and a third in the activation dtype when that is not
fp32 (the GEMM's output before its fp32 copy), which must fit 1/LM_HEAD_CPU_MEMORY_SHARE of the
host's memory, so a small host takes fewer tokens at a time (never fewer than 32): at GPT-OSS's
201,088 in fp32, 256 tokens (412 MB kept) on a host of 13.2 GB or more, 160 on one of 8 GiB. Fewer
tokens cost time on the CPU too, as every chunk reads the output layer's weight once: with reused
buffers, 256 tokens ran 5% faster than 128 and 1.5x faster than 32 at hidden 64 and vocabulary
201,088, 9% and 1.4x faster at hidden 512. On a GPU the output layer's weight gradient is
accumulated over the chunks in fp32: every chunk's GEMM reads and writes the [V, h] accumulator once
(8 V h bytes), against 2 V h x chunk FLOPs, so a chunk of c tokens does c/4 FLOPs per byte of
accumulator traffic and needs c in the thousands to stay compute-bound on an H100 (about 300 FLOPs
per byte). The chunk is the largest multiple of 256, at most 4096, whose logits fit
LM_LOSS_CHUNK_GPU_BYTES: 1280 tokens at GPT-OSS's vocabulary of 201,088 in bf16 (3.6 GB), 4096 for
the tiny preset.
"""

from __future__ import annotations

from gptoss_cli.resources import total_memory_bytes

LM_LOSS_CHUNK_TOKENS = 256  # the CPU's chunk, and the GPU's smallest
LM_LOSS_CHUNK_MAX_TOKENS = 4096
LM_LOSS_CHUNK_GPU_BYTES = 4 * 2**30  # one chunk's logits, their fp32 copy and gradient on a GPU
LM_HEAD_CPU_MEMORY_SHARE = 32  # a CPU chunk's kept buffers take at most this fraction (1/32) of the host's memory
LM_HEAD_CPU_MIN_TOKENS = 32


def lm_loss_chunk_tokens(vocab_size: int, activation_bytes: int, device_type: str,
                         host_memory: int | None = None) -> int:
    """Tokens per chunk of the LM head + loss on a device of this type ("cpu", "cuda", ...); on the CPU
    sized for `host_memory` bytes (default: this host's total memory)."""
    if device_type == "cpu":
        if host_memory is None:
            host_memory = total_memory_bytes()
        if host_memory is None:
            return LM_LOSS_CHUNK_TOKENS
        per_token = (8 + (activation_bytes if activation_bytes != 4 else 0)) * max(1, vocab_size)
        fits = host_memory // LM_HEAD_CPU_MEMORY_SHARE // per_token // LM_HEAD_CPU_MIN_TOKENS * LM_HEAD_CPU_MIN_TOKENS
        return max(LM_HEAD_CPU_MIN_TOKENS, min(LM_LOSS_CHUNK_TOKENS, fits))
    per_token = (activation_bytes + 12) * max(1, vocab_size)
    fits = LM_LOSS_CHUNK_GPU_BYTES // per_token // LM_LOSS_CHUNK_TOKENS * LM_LOSS_CHUNK_TOKENS
    return max(LM_LOSS_CHUNK_TOKENS, min(LM_LOSS_CHUNK_MAX_TOKENS, fits))


__all__ = ["LM_LOSS_CHUNK_TOKENS", "LM_LOSS_CHUNK_MAX_TOKENS", "LM_LOSS_CHUNK_GPU_BYTES", "LM_HEAD_CPU_MEMORY_SHARE",
           "LM_HEAD_CPU_MIN_TOKENS", "lm_loss_chunk_tokens"]
