"""Error bounds of an FP8 GEMM, derived from the formats' precision (independent of gptoss's code).

Element model. Casting x to a format with m mantissa bits after dividing by its group's decode
scale d (round to nearest) errs by at most
    |Q(x) - x| <= max(u |x|, h d) + 2^-24 |x|,
u = 2^-(m+1) (e4m3: 2^-4, e5m2: 2^-3) in the normal range, h = half the smallest subnormal
(e4m3: 2^-10, e5m2: 2^-17) below it, and 2^-24 for x / d rounded to fp32 first. d follows the
rule of the scaling, recomputed here from the definition: amax / max per tensor or per row, or
2^ceil(log2(amax / max)) per 32 values along the contraction axis (MX).

GEMM, worst case (rigorous, elementwise). With E_a, E_b those element bounds, the fp32 sum of K
products (error <= K 2^-24 sum|terms|, Higham 3.1) and one rounding to the output dtype (u_out):
    |C^ - C| <= E_a |B|^T + |A| E_b^T + E_a E_b^T + K 2^-24 (|A| + E_a)(|B| + E_b)^T + u_out |C^|.

GEMM, typical (random signs). The element errors are zero-mean with RMS relative size at most
u / sqrt(3) (uniform in +-u), so C^ - C = sum_k a_k b_k (delta_k + eps_k) is a random walk of K
steps, like C itself: the relative Frobenius error is about sqrt((u_a^2 + u_b^2) / 3), whatever K
(each sum grows as sqrt(K)). e4m3 x e4m3: 0.051; e5m2 x e4m3: 0.081. Tests allow twice that, and
require at least an eighth of it, which a GEMM that skipped quantisation (bf16: 0.002) misses.
"""

from __future__ import annotations

import math

import torch

from tests.tolerances import U_FP32

FORMATS = {"e4m3": (448.0, 2.0**-4, 2.0**-10), "e5m2": (57344.0, 2.0**-3, 2.0**-17)}
U_OUT = {torch.float32: U_FP32, torch.bfloat16: 2.0**-8}


def decode_scales(t: torch.Tensor, fmt: str, scaling: str) -> torch.Tensor:
    """d per element of `t [rows, K]` (quantised along K) by the scaling's definition."""
    fmax = FORMATS[fmt][0]
    a = t.double().abs()
    if scaling == "tensor":
        return (a.max() / fmax).expand_as(a)
    if scaling == "row":
        return (a.amax(dim=1, keepdim=True) / fmax).expand_as(a)
    rows, k = a.shape
    pad = (-k) % 32
    blocks = torch.nn.functional.pad(a, (0, pad)).view(rows, -1, 32)
    amax = blocks.amax(dim=-1, keepdim=True)
    d = torch.exp2(torch.ceil(torch.log2(amax / fmax)))
    return torch.where(amax > 0, d, torch.zeros_like(d)).expand_as(blocks).reshape(rows, -1)[:, :k]


def element_bound(t: torch.Tensor, fmt: str, scaling: str) -> torch.Tensor:
    _, u, h = FORMATS[fmt]
    a = t.double().abs()
    return torch.maximum(u * a, h * decode_scales(t, fmt, scaling)) + U_FP32 * a


def gemm_bound(a: torch.Tensor, b: torch.Tensor, fmt_a: str, fmt_b: str, scaling: str,
               result: torch.Tensor) -> torch.Tensor:
    """Worst-case |C^ - C| per element of C = a [M, K] @ b [N, K]^T (see the module docstring)."""
    ea, eb = element_bound(a, fmt_a, scaling), element_bound(b, fmt_b, scaling)
    aa, ab = a.double().abs(), b.double().abs()
    k = a.shape[1]
    return (ea @ ab.t() + aa @ eb.t() + ea @ eb.t() + k * U_FP32 * (aa + ea) @ (ab + eb).t()
            + U_OUT[result.dtype] * result.double().abs())


def typical_relative_error(fmt_a: str, fmt_b: str) -> float:
    """sqrt((u_a^2 + u_b^2) / 3): the expected relative Frobenius error of a random-sign GEMM."""
    return math.sqrt((FORMATS[fmt_a][1] ** 2 + FORMATS[fmt_b][1] ** 2) / 3)


def check_gemm(result: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fmt_a: str, fmt_b: str, *, scaling: str,
               what: str, extra: torch.Tensor | None = None, worst_case: bool = True, typical: bool = True) -> None:
    """Assert the FP8 result of a @ b^T (+ extra, added exactly in the reference) is within the
    worst-case bound per element and/or near the typical relative error (see the module docstring)."""
    exact = a.double() @ b.double().t()
    if extra is not None:
        exact = exact + extra.double()
    err = (result.double() - exact).abs()
    if worst_case:
        bound = gemm_bound(a, b, fmt_a, fmt_b, scaling, result)
        worst = (err / bound).max().item()
        assert worst <= 1.0, f"{what}: an element is {worst:.3g}x its worst-case bound"
    if typical:
        rel = (err.norm() / exact.norm()).item()
        model = typical_relative_error(fmt_a, fmt_b)
        assert model / 8 <= rel <= 2 * model, f"{what}: relative error {rel:.4f}, model {model:.4f}"
