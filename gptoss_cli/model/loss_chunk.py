"""How many tokens the chunked LM head + loss takes at a time, per device (torch-free: the memory estimate reads it too).

Per token of a chunk the head holds its logits in the activation dtype, their fp32 copy for the
loss and the loss's fp32 gradient (b + 12 bytes x vocabulary, recipe/estimate/memory.py's "logits"). On
the CPU the chunk stays small (256 tokens: a chunk of a 20k vocabulary stays in cache, 11% faster
in bench/train.py). On a GPU the output layer's weight gradient is accumulated over the chunks in
fp32: every chunk's GEMM reads and writes the [V, h] accumulator once (8 V h bytes), against
2 V h x chunk FLOPs, so a chunk of c tokens does c/4 FLOPs per byte of accumulator traffic and
needs c in the thousands to stay compute-bound on an H100 (about 300 FLOPs per byte). The chunk
is the largest multiple of 256, at most 4096, whose logits fit LM_LOSS_CHUNK_GPU_BYTES: 1280
tokens at GPT-OSS's vocabulary of 201,088 in bf16 (3.6 GB), 4096 for the tiny preset.
"""

from __future__ import annotations

LM_LOSS_CHUNK_TOKENS = 256  # the CPU's chunk, and the GPU's smallest
LM_LOSS_CHUNK_MAX_TOKENS = 4096
LM_LOSS_CHUNK_GPU_BYTES = 4 * 2**30  # one chunk's logits, their fp32 copy and gradient on a GPU


def lm_loss_chunk_tokens(vocab_size: int, activation_bytes: int, device_type: str) -> int:
    """Tokens per chunk of the LM head + loss on a device of this type ("cpu", "cuda", ...)."""
    if device_type == "cpu":
        return LM_LOSS_CHUNK_TOKENS
    per_token = (activation_bytes + 12) * max(1, vocab_size)
    fits = LM_LOSS_CHUNK_GPU_BYTES // per_token // LM_LOSS_CHUNK_TOKENS * LM_LOSS_CHUNK_TOKENS
    return max(LM_LOSS_CHUNK_TOKENS, min(LM_LOSS_CHUNK_MAX_TOKENS, fits))


__all__ = ["LM_LOSS_CHUNK_TOKENS", "LM_LOSS_CHUNK_MAX_TOKENS", "LM_LOSS_CHUNK_GPU_BYTES", "lm_loss_chunk_tokens"]
