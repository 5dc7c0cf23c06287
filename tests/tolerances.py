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


# --- the clamped SwiGLU: compiled single-pass kernels against the eager Function -----------------
#
# Error model. Both forms compute from the same inputs; the clamps are exact, and x = alpha * g is
# one rounded multiply in both, so they see the same x. They differ in (1) the sigmoid: each
# implementation (ATen's vectorised exp, Inductor's) is taken to be within SIGMOID_ULPS units of
# roundoff of the true sigmoid of x (exp to 1 ulp, then an add and a division, each correctly
# rounded); (2) how the products are rounded or contracted (another order, an FMA): every rounding
# adds at most one unit roundoff u of the magnitude it acts on. So, per element, each form lies within
# (SIGMOID_ULPS + r) * u * T of the exact value of the formula at that x, and the two within twice
# that, where r counts the roundings on the element's longest chain and T bounds the magnitudes
# summed there:
#   out    = (u' + 1) * g * s                 r = 3  T = |out|
#   d_up   = g * s * dy                       r = 2  T = |g * s * dy|
#   d_gate = s * (1 + x (1 - s)) (u' + 1) dy  r = 6  T = s (1 + |x|) |u' + 1| |dy|
# (u' the clamped up, g the clamped gate, s = sigmoid(x); in d_gate, s's error is amplified by
# d/ds [s + x s (1 - s)] = 1 + x (1 - 2s), at most 1 + |x|, hence T.) Subnormal results (x below
# about -87) carry an absolute error of a few subnormal units on top: SUBNORMAL_ABS.
# bf16: the compiled kernel computes in fp32 and rounds once, so it lies within one bf16 roundoff
# (2**-8) of the fp32 result plus the fp32 bound above.

SIGMOID_ULPS = 4
U_BF16 = 2.0**-8
SUBNORMAL_ABS = 2.0**-126


def swiglu_error_bounds(gate_up: torch.Tensor, grad_out: torch.Tensor, limit: float, alpha: float,
                        u: float = U_FP32) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element bounds (fp64) on |compiled - eager| of the clamped SwiGLU's output `[N, I]` and of its
    input gradient `[N, 2I]`, by the error model above (u: the unit roundoff of the compute dtype)."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    dy = grad_out.double().abs()
    g = gate.clamp(max=limit)
    x = g * alpha
    s = torch.sigmoid(x)
    up1 = (up.clamp(-limit, limit) + 1).abs()
    out = up1 * g.abs() * s
    d_up = g.abs() * s * dy
    d_gate = s * (1 + x.abs()) * up1 * dy
    both = lambda r, t: 2 * (SIGMOID_ULPS + r) * u * t + SUBNORMAL_ABS  # noqa: E731
    return both(3, out), torch.cat([both(6, d_gate), both(2, d_up)], dim=-1)
