"""The experts' FP8 GEMMs as one `torch._scaled_grouped_mm` each, with the counts kept on the device.

Where it runs (`available`): CUDA GPUs of compute capability 9.x or 10.x with
`torch._scaled_grouped_mm` (torch 2.8 and later; torch gates the kernel on exactly those majors).
What it takes (`supports`; torch's aten/src/ATen/native/cuda/GroupedBlas.cpp and
GroupMMCommon.cuh, the same in 2.11 and 2.13): e4m3 operands on both sides (so only
`fp8_format=e4m3` gradients; `hybrid`'s e5m2 output gradients keep the per-expert loop), fp32
scales of rowwise shape, bf16 output, contraction and output features multiples of 16, fewer than
1024 groups. Tensorwise scales (one per expert operand) are given in rowwise shape, every row the
expert's scale, which is the same scaling. MXFP8 (`_scaled_grouped_mm` with e8m0 scales) needs
its scales in cuBLAS's tiled layout per expert group, padded per group; not implemented, so mxfp8
keeps the per-expert loop of block-scaled `_scaled_mm` (fp8/grouped.py).

Layouts, for rows sorted by local expert (`offs` = the running sum of the counts, int32 on the device):

    fprop  2d x 3d:  a = x  [N, in]  row-major, scale_a [N];   b = W^T [E, in, out] column-major, scale_b [E, out]
    dgrad  2d x 3d:  a = dy [N, out] row-major, scale_a [N];   b = W   [E, out, in] column-major, scale_b [E, in]
    wgrad  2d x 2d:  a = dy^T [out, Np] row-major, scale_a [E * out];  b = x [Np, in] column-major, scale_b [E * in]

In wgrad the token axis is each group's contraction axis, and the kernel needs each group's length
a positive multiple of 16 (its TMA loads start on 16-byte boundaries): every expert's tokens are
copied into a zero-padded buffer of `N + 16 E` rows (an upper bound known without reading the
counts) at offsets padded to 16, at least 16 for an empty expert; zero rows change no sum.

The operands are quantised exactly as the per-expert loop quantises each expert's own operands
(the same amaxes, scales and fp8 bytes: tests/fp8/test_grouped_kernel.py), by the functions
below, compiled where fp8/fused.py verified them. The per-expert amaxes come from
`scatter_reduce(amax)` over the rows' expert ids, with NaN mapped to inf first and recorded apart
(whether a device's atomic max propagates NaN does not matter). Their per-expert maxima are the
NaN/inf check (`{expert}` in the operand's name), masked to 0 for experts without tokens, whose
operands the loop never reads.
"""

from __future__ import annotations

import torch

from gptoss_cli import torch_private
from gptoss_cli.fp8 import fused
from gptoss_cli.fp8.scaling import E4M3, Fp8Format, cast_saturating_math, decode_scale

GROUP_ALIGN = 16
MAX_GROUPS = 1024


def available(device: torch.device) -> bool:
    """Whether this device has torch's grouped FP8 kernel (CUDA sm90 / sm100)."""
    if device.type != "cuda" or not torch_private.has_scaled_grouped_mm() or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def supports(scaling: str, fa: Fp8Format, fb: Fp8Format, k: int, n: int, out_dtype: torch.dtype, groups: int) -> bool:
    """Whether one grouped GEMM of these formats and sizes fits the kernel's contract."""
    return (scaling in ("tensor", "row") and fa is E4M3 and fb is E4M3 and out_dtype == torch.bfloat16
            and k % GROUP_ALIGN == 0 and n % GROUP_ALIGN == 0 and 0 < groups < MAX_GROUPS)


def run(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
        offs: torch.Tensor) -> torch.Tensor:
    """The kernel call (the one line that needs a GPU; the tests put a contract-checking emulation here)."""
    return torch_private.scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)


# --- quantisation per expert, the counts on the device ----------------------------------------------
def _expert_max(values: torch.Tensor, expert_of_row: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[N] or [N, C] non-negative values -> their maximum per expert ([E] or [E, C]); NaN wins."""
    key = torch.where(torch.isnan(values), torch.inf, values)
    index = expert_of_row if values.dim() == 1 else expert_of_row.unsqueeze(1).expand_as(values)
    shape = (num_experts,) + tuple(values.shape[1:])
    out = values.new_zeros(shape).scatter_reduce(0, index, key, "amax")
    nan_rows = torch.isnan(values) if values.dim() == 1 else torch.isnan(values).any(dim=1)
    has_nan = values.new_zeros(num_experts).scatter_reduce(0, expert_of_row, nan_rows.float(), "amax")
    return torch.where((has_nan > 0).view((num_experts,) + (1,) * (values.dim() - 1)), torch.nan, out)


def rows_math(x: torch.Tensor, expert_of_row: torch.Tensor, num_experts: int, fmax: float, dtype: torch.dtype,
              tensorwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, K] rows by expert, quantised along K: (fp8 [N, K], decode scale per row [N], peak per expert [E]).
    Rowwise: each row its own scale; tensorwise: each row its expert's."""
    x = x.float()
    row_amax = x.abs().amax(dim=1)
    peaks = _expert_max(row_amax, expert_of_row, num_experts)
    scale = decode_scale(peaks, fmax)[expert_of_row] if tensorwise else decode_scale(row_amax, fmax)
    return cast_saturating_math(x / scale.unsqueeze(1), fmax, dtype), scale, peaks


def weights_math(w: torch.Tensor, fmax: float, dtype: torch.dtype, tensorwise: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [E, R, K] quantised along K: (fp8 [E, R, K], decode scales [E, R], peak per expert [E])."""
    w = w.float()
    row_amax = w.abs().amax(dim=2)
    peaks = row_amax.amax(dim=1)
    scale = decode_scale(peaks, fmax).unsqueeze(1).expand_as(row_amax) if tensorwise else decode_scale(row_amax, fmax)
    return cast_saturating_math(w / scale.unsqueeze(2), fmax, dtype), scale.contiguous(), peaks


def tokens_math(x: torch.Tensor, expert_of_row: torch.Tensor, num_experts: int, fmax: float, dtype: torch.dtype,
                tensorwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, C] rows by expert, quantised along the tokens of each expert (wgrad's contraction axis):
    (fp8 [N, C], decode scales [E, C], peak per expert [E])."""
    x = x.float()
    col_amax = _expert_max(x.abs(), expert_of_row, num_experts)  # [E, C]
    peaks = col_amax.amax(dim=1)
    scale = decode_scale(peaks, fmax).unsqueeze(1).expand_as(col_amax) if tensorwise else decode_scale(col_amax, fmax)
    return cast_saturating_math(x / scale[expert_of_row], fmax, dtype), scale.contiguous(), peaks


def _probe_args(device: torch.device) -> list[tuple]:
    x = fused.edge_values(device, rows=8, cols=64)
    experts = torch.tensor([0, 0, 2, 2, 2, 3, 3, 3], device=device)  # expert 1 has no rows
    return [(x, experts, 4, E4M3.max, E4M3.dtype, tensorwise) for tensorwise in (False, True)]


def _weight_probe_args(device: torch.device) -> list[tuple]:
    w = fused.edge_values(device, rows=4, cols=64, seed=1).view(2, 2, 64)
    return [(w, E4M3.max, E4M3.dtype, tensorwise) for tensorwise in (False, True)]


fused.register(rows_math, _probe_args)
fused.register(tokens_math, _probe_args)
fused.register(weights_math, _weight_probe_args)


# --- the three GEMMs ---------------------------------------------------------------------------------
def fprop(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor, expert_of_row: torch.Tensor,
          fmt: Fp8Format, tensorwise: bool) -> tuple[torch.Tensor, list[tuple[torch.Tensor, str]]]:
    """y [N, out] = x_e @ W_e^T per expert; returns (y, [(peaks, operand)]) for the NaN/inf check."""
    e = weight.shape[0]
    qx, sx, px = fused.kernel(rows_math, x.device)(x, expert_of_row, e, fmt.max, fmt.dtype, tensorwise)
    qw, sw, pw = fused.kernel(weights_math, x.device)(weight, fmt.max, fmt.dtype, tensorwise)
    y = run(qx, qw.transpose(-2, -1), sx, sw, _offsets(tokens_per_expert))
    return y, [(px, "input"), (_only_used(pw, tokens_per_expert), "weight")]


def dgrad(dy: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor, expert_of_row: torch.Tensor,
          fmt: Fp8Format, tensorwise: bool) -> tuple[torch.Tensor, list[tuple[torch.Tensor, str]]]:
    """dx [N, in] = dy_e @ W_e per expert (W re-quantised along out)."""
    e = weight.shape[0]
    qd, sd, pd = fused.kernel(rows_math, dy.device)(dy, expert_of_row, e, fmt.max, fmt.dtype, tensorwise)
    wt = weight.transpose(-2, -1).contiguous()  # [E, in, out]: quantised along out
    qw, sw, pw = fused.kernel(weights_math, dy.device)(wt, fmt.max, fmt.dtype, tensorwise)
    dx = run(qd, qw.transpose(-2, -1), sd, sw, _offsets(tokens_per_expert))
    return dx, [(pd, "output gradient"), (_only_used(pw, tokens_per_expert), "weight")]


def wgrad(x: torch.Tensor, dy: torch.Tensor, tokens_per_expert: torch.Tensor, expert_of_row: torch.Tensor,
          fmt: Fp8Format, tensorwise: bool) -> tuple[torch.Tensor, list[tuple[torch.Tensor, str]]]:
    """dW [E, out, in] = dy_e^T @ x_e per expert: both quantised along each expert's tokens, then
    copied into the padded token buffer."""
    e = tokens_per_expert.numel()
    qd, sd, pd = fused.kernel(tokens_math, x.device)(dy, expert_of_row, e, fmt.max, fmt.dtype, tensorwise)
    qx, sx, px = fused.kernel(tokens_math, x.device)(x, expert_of_row, e, fmt.max, fmt.dtype, tensorwise)
    dest, offs, rows = padded_rows(tokens_per_expert, expert_of_row)
    a = _scatter_rows(qd, dest, rows).t().contiguous()  # [out, Np] row-major
    b = _scatter_rows(qx, dest, rows).t().contiguous().t()  # [Np, in] column-major
    dw = run(a, b, sd.reshape(-1), sx.reshape(-1), offs)
    return dw, [(pd, "output gradient"), (px, "input")]


def padded_rows(tokens_per_expert: torch.Tensor, expert_of_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(destination row of every row in the padded buffer [N], the padded groups' end offsets int32 [E],
    the buffer's rows `N + 16 E` rounded up to 16): each group starts on a multiple of 16 and spans
    at least 16 rows."""
    counts = tokens_per_expert.to(torch.int64)
    padded = ((counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN).clamp(min=GROUP_ALIGN)
    ends = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    row = torch.arange(expert_of_row.numel(), device=expert_of_row.device)
    dest = row - starts[expert_of_row] + (ends - padded)[expert_of_row]
    total = expert_of_row.numel() + GROUP_ALIGN * counts.numel()
    return dest, ends.to(torch.int32), -(-total // GROUP_ALIGN) * GROUP_ALIGN


def _scatter_rows(q: torch.Tensor, dest: torch.Tensor, rows: int) -> torch.Tensor:
    """fp8 [N, C] -> zeros [rows, C] with row i at dest[i] (through a byte view: fp8 has no index_copy)."""
    out = torch.zeros(rows, q.shape[1], dtype=torch.uint8, device=q.device)
    return out.index_copy_(0, dest, q.view(torch.uint8)).view(q.dtype)


def _offsets(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(tokens_per_expert, 0).to(torch.int32)


def _only_used(peaks: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """A weight's peaks where its expert has tokens, else 0 (the loop never reads an idle expert's weight)."""
    return torch.where(tokens_per_expert > 0, peaks, torch.zeros_like(peaks))


__all__ = ["available", "supports", "run", "fprop", "dgrad", "wgrad", "padded_rows", "rows_math", "weights_math",
           "tokens_math", "GROUP_ALIGN"]
