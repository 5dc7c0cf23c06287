"""The gradient-buffer bucket layout's two numbers, shared by the buffers and the memory estimate (no torch here).

gptoss_cli/parallel/grads.py builds the buffers; gptoss_cli/recipe/estimate/memory.py predicts their size
and must stay torch-free, and parallel/ may not import recipe/: both import these from here.
"""

from __future__ import annotations

# Every bucket is a multiple of ALIGN x shards elements, so every shard starts 256-byte aligned in
# the fp32 gradient buffer (and 128-byte aligned in a bf16 parameter buffer).
ALIGN = 64


def default_bucket_size(dp_size: int) -> int:
    """Megatron's default bucket size in elements: max(40M, 1M x data-parallel size)."""
    return max(40_000_000, 1_000_000 * dp_size)


__all__ = ["ALIGN", "default_bucket_size"]
