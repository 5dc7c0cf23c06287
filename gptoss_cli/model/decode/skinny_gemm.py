"""`x @ W^T` for the few rows of a decoding step against a large fp32 weight on the CPU, in blocks of output rows.

A decoding step multiplies a handful of rows (one per prompt of a batch) by a weight read from
memory once: the LM head (vocabulary x hidden) and, at real widths, each chosen expert's fc1/fc2.
Such a product is bound by reading the weight, about 8-11 GB/s on one core of the machine the
benches run on. torch's fp32 CPU GEMM (MKL's sgemm) gets there with 1-2 rows, but with 4-12 rows
against a weight of many megabytes it falls to 2-5 GB/s (bench/generate.py's `--gemm` sweep:
20480 x 512 at 8 rows, 2.7 GB/s), a blocking choice of the library, not the arithmetic. The same
product taken in blocks of output rows whose weight slice is about 512 KiB (so the library's
working set per call stays in the core's L2) reads 1.1-2.2x faster (4.2-9.2 GB/s at 8 rows in the
sweeps so far). Each output element is still one
dot product over the whole hidden dimension, so the blocks change which kernel computes it, not
what it computes (the tests hold the two to fp32 rounding, and greedy tokens to transformers').

bf16 runs through another library (oneDNN) that blocking makes slower, so `skinny_linear` blocks
only fp32 CPU operands with `BLOCKED_ROWS` rows against at least `BLOCKED_MIN_BYTES` of weight;
everything else is `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Row counts the blocked form is taken for (below 4 and from 16 on, the library's own blocking
# reads the weight as fast or faster).
BLOCKED_ROWS = range(4, 13)
# Weights below this stay whole: at 2 MiB (a 1024 x 512 expert fc1) the blocks gain little.
BLOCKED_MIN_BYTES = 4 << 20
# The weight slice per call.
BLOCK_BYTES = 512 << 10


def weight_blocked(weight: torch.Tensor) -> bool:
    """Whether `weight` is one `skinny_linear` takes in blocks (for fp32 CPU inputs of BLOCKED_ROWS
    rows): a plain fp32 CPU tensor of at least BLOCKED_MIN_BYTES."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.numel() * weight.element_size() >= BLOCKED_MIN_BYTES
            and type(weight) in (torch.Tensor, torch.nn.Parameter))


def blocked(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear(x, weight)` takes the blocked form."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] in BLOCKED_ROWS
            and type(x) is torch.Tensor and weight_blocked(weight))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [M, in], weight [out, in], written into `out` [M, out] when
    given. For decoding under `torch.no_grad()` (its callers' context): the blocked form writes
    into slices of one output, which autograd does not follow."""
    if not blocked(x, weight):
        if out is None:
            return F.linear(x, weight, bias)
        if bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)
    out_features, in_features = weight.shape
    rows = max(8, BLOCK_BYTES // (in_features * weight.element_size()) // 8 * 8)
    out = x.new_empty(x.shape[0], out_features) if out is None else out
    for start in range(0, out_features, rows):
        block = weight[start:start + rows]
        if bias is None:
            torch.mm(x, block.t(), out=out[:, start:start + rows])
        else:
            torch.addmm(bias[start:start + rows], x, block.t(), out=out[:, start:start + rows])
    return out


__all__ = ["BLOCKED_MIN_BYTES", "BLOCKED_ROWS", "blocked", "skinny_linear", "weight_blocked"]
