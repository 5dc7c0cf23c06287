"""`torch._scaled_grouped_mm` on the CPU for the tests: its contract checked, then each group through torch's CPU `_scaled_mm`.

torch has no CPU kernel for `_scaled_grouped_mm`. This stand-in asserts what the CUDA op checks
(torch's aten/src/ATen/native/cuda/GroupedBlas.cpp, `_scaled_grouped_mm_cuda` and
`check_scale`; GroupMMCommon.cuh, `prepare_grouped_gemm_data`, for the per-group offsets, the
scale pointers and the 2d-2d group lengths) and computes every group with the CPU `_scaled_mm`
kernel the per-expert loop uses, so the grouped path's layouts, strides, offsets and scales are
checked against the loop, not against themselves:
  - e4m3 operands; mat_a 2-D row-major, mat_b 2-D or 3-D column-major; every leading stride a
    multiple of 16 bytes; mat_a's last dimension and both of mat_b's multiples of 16;
  - fp32 scales: 2d-3d scale_a [M] contiguous, scale_b [G, N] with unit last stride; 2d-2d
    scale_a [G * M] and scale_b [G * N] (group g's at g * M and g * N);
  - offs int32, one dimension; 2d-2d: every group's length positive, all but the last a multiple
    of 16 (the TMA alignment), the last within mat_a;
  - output bf16, fewer than 1024 groups.

`exact_scaled_mm` is `torch._scaled_mm`'s numerics without a kernel's summation order, for tests that
compare two ways of laying out the same GEMMs bit for bit (see its docstring).
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn


# e4m3 values are integer multiples of 2**-9 (its smallest subnormal) of magnitude at most 448 < 2**9.
E4M3_QUANTUM_LOG2, E4M3_MAX_LOG2 = -9, 9
MAX_EXACT_K = 1 << 10


def exact_scaled_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor, scale_b: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16, **_: object) -> torch.Tensor:
    """`a @ b` of fp8 operands scaled by `scale_a` (tensorwise, or a column [M, 1]) and `scale_b` (tensorwise,
    or a row [1, N]), with no summation-order rounding: the product sum is exact, whatever the order.

    Why it is exact: every product of two e4m3 values is an integer multiple of 2**-18 below 2**18, so any
    partial sum of at most 2**10 of them is an integer multiple of 2**-18 below 2**28: 46 significant bits,
    which fp64's 53 hold. The sum is then scaled (fp64, in one fixed order: sum x scale_a x scale_b) and
    rounded once to `out_dtype`, elementwise IEEE operations every CPU computes alike. torch's own CPU
    kernel accumulates in fp32 in an order that depends on the CPU (its GEMM kernel, its blocking for the
    contraction length): two layouts of the same products may then round differently, which is not what
    a layout test is about."""
    assert a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and b.dtype == a.dtype, (a.dtype, b.dtype)
    assert a.shape[-1] <= MAX_EXACT_K, ("contraction too long for an exact fp64 sum", a.shape)
    acc = a.double() @ b.double()
    return (acc * scale_a.double() * scale_b.double()).to(out_dtype)


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(-2) >= max(1, t.shape[-1]) and t.stride(-2) % 16 == 0


def _col_major(t: torch.Tensor) -> bool:
    return t.stride(-2) == 1 and t.stride(-1) >= max(1, t.shape[-2]) and t.stride(-1) % 16 == 0


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
                      offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    assert a.dtype == E4M3 and b.dtype == E4M3, (a.dtype, b.dtype)
    assert a.dim() == 2 and b.dim() in (2, 3), (a.shape, b.shape)
    assert _row_major(a), ("mat_a not row-major with 16-byte rows", a.stride())
    assert _col_major(b), ("mat_b not column-major with 16-byte columns", b.stride())
    assert a.shape[-1] % 16 == 0 and b.shape[-2] % 16 == 0 and b.shape[-1] % 16 == 0, (a.shape, b.shape)
    assert scale_a.dtype == scale_b.dtype == torch.float32
    assert offs.dtype == torch.int32 and offs.dim() == 1
    assert out_dtype == torch.bfloat16
    groups = offs.numel()
    assert 0 < groups < 1024
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:  # 2d x 3d: rows of a jagged
        m, (g, k, n) = a.shape[0], b.shape
        assert g == groups and a.shape[1] == k
        assert scale_a.dim() == 1 and scale_a.is_contiguous() and scale_a.numel() == m
        assert scale_b.dim() == 2 and scale_b.stride(-1) == 1 and scale_b.shape == (g, n)
        assert ends[-1] <= m and all(e >= s for s, e in zip(starts, ends))
        out = torch.zeros(m, n, dtype=out_dtype)
        for i, (s, e) in enumerate(zip(starts, ends)):
            if e > s:
                out[s:e] = torch._scaled_mm(a[s:e], b[i], scale_a=scale_a[s:e, None], scale_b=scale_b[i][None, :],
                                            out_dtype=out_dtype)
        return out
    m, n = a.shape[0], b.shape[1]  # 2d x 2d: the contraction axis jagged
    assert a.shape[1] == b.shape[0]
    assert scale_a.dim() == 1 and scale_a.numel() == groups * m and scale_b.dim() == 1 and scale_b.numel() == groups * n
    lengths = [e - s for s, e in zip(starts, ends)]
    assert all(length > 0 for length in lengths), ("a group of length 0 (CUTLASS cannot)", lengths)
    assert all(length % 16 == 0 for length in lengths[:-1]), ("group not 16-aligned", lengths)
    assert ends[-1] <= a.shape[1]
    out = torch.empty(groups, m, n, dtype=out_dtype)
    for i, (s, e) in enumerate(zip(starts, ends)):
        out[i] = torch._scaled_mm(a[:, s:e], b[s:e], scale_a=scale_a[i * m:(i + 1) * m, None],
                                  scale_b=scale_b[i * n:(i + 1) * n][None, :], out_dtype=out_dtype)
    return out
