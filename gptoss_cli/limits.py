"""Integer bounds that recipes, checkpoints and data files are checked against (torch-free)."""

from __future__ import annotations

# Sizes (tensor dimensions, process counts, bucket elements) and counts (steps, intervals): int32, what
# torch's index kernels, NCCL counts and rank numbers take; with it the sample index (step x
# global_batch_size) stays far inside int64.
INT32_MAX = 2**31 - 1


# numpy and Megatron seed with at most 2**32 - 1; the data sources seed torch generators with
# seed x 1_000_003 + sample index, which must stay below 2**64 (torch.Generator.manual_seed).
SEED_MAX = 2**32 - 1

__all__ = ["INT32_MAX", "SEED_MAX"]
