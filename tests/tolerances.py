"""Tolerances for comparing two fp32 code paths, derived from an error model instead of one run.

Error model. Two code paths that compute the same mathematical quantity from the SAME inputs
(same weights, same tokens) differ only in the order of floating-point additions: a different
schedule, a different EP/DP layout (all-to-all, all-reduce), a grouped GEMM against a loop. A sum
of n terms in fp32 carries a rounding error of at most gamma_n * sum|terms|, gamma_n ~ n*u,
u = 2**-24 (Higham, "Accuracy and Stability of Numerical Algorithms", section 4.2); with terms of
random sign the errors behave as a random walk (~ sqrt(n) * u * sum|terms|) and sum|terms| is
about sqrt(n) * |result|, so two orders differ by about n * u * |result|. A backward pass through
`depth` layers compounds one such error per layer, and the largest element of a tensor sits a few
standard deviations out (`safety`). Hence, per tensor,

    max|a - b| <= safety * depth * n * u * max|b|,   safety = 4.

The bound depends on the sizes of the sums only, not on which kernels or how many threads a CPU
uses, and it sits far below what a real bug produces: a lost microbatch or token, a missing or
doubled reduction changes results by a visible fraction of their size.

What it does NOT cover: results after optimizer steps taken separately by the two paths. AdamW
normalises each gradient element, so a rounding-level difference in a near-zero gradient becomes a
whole +-lr step; after that the paths compare different weights. Tests therefore compare from the
same weights at every step (copy the reference's weights into the candidate before each step).
"""

from __future__ import annotations

import torch

U_FP32 = 2.0**-24


SAFETY = 4.0


def reassociation_rel(n_terms: int, depth: int = 1, u: float = U_FP32) -> float:
    """Relative bound (to a tensor's largest magnitude) between two orders of n-term fp32 sums
    compounded over `depth` layers (see the module's error model)."""
    return SAFETY * depth * n_terms * u


def assert_tensors_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rel: float,
                         context: object = "") -> None:
    """Same names; every tensor within `rel` of its own largest magnitude (see the module's model)."""
    assert set(actual) == set(expected), (context, sorted(set(actual) ^ set(expected))[:5])
    for name, want in expected.items():
        err = (actual[name].double() - want.double()).abs().max().item() if want.numel() else 0.0
        scale = want.double().abs().max().item() if want.numel() else 0.0
        assert err <= rel * scale + 1e-30, f"{context} {name}: max |diff| {err:.3g} vs {rel:.2g} x scale {scale:.3g}"
