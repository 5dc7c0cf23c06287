"""One FP8 GEMM, `a @ b^T` with both operands quantised along the contraction axis K, and its kernels.

Numerics: `a [M, K]` and `b [N, K]` are quantised along K (gptoss_cli/fp8/scaling.py) in the
format of their role: forward operands (inputs, weights) in e4m3; output gradients in e5m2 under
the `hybrid` format, else e4m3. The product sum_k qa[m,k] qb[n,k] x scales is accumulated in fp32
and rounded once to the output dtype. Callers put the contraction axis last, so every GEMM
(forward, input gradient, weight gradient) quantises its operands along its own contraction axis:
a transposed operand is re-quantised, never reused with blocks along the wrong axis.

K is padded with zeros to a multiple of 32 for MX (whole blocks) and of 16 for the native
`torch._scaled_mm` (its alignment rule, as N is); zero padding changes neither a scale nor a
product.

Kernels (chosen once per run by gptoss_cli/fp8/selection.py, never switched silently):
  scaled_mm        `torch._scaled_mm` with fp32 tensorwise or rowwise scales. FP8 tensor cores
                   on CUDA sm90+ (native); on CPU torch's reference kernel computes the same
                   numerics (emulated: no FP8 hardware).
  block_scaled_mm  `torch._scaled_mm` with UE8M0 scales per 32 values, laid out as cuBLAS wants
                   them (the 128x4 tiled "swizzle"); CUDA sm100+ (native). Not run on hardware
                   by this project's tests.
  dequantize       both operands dequantised exactly to fp32, then an fp32 matmul: the emulation
                   for MXFP8 off Blackwell and for tensorwise/rowwise on devices without a
                   `torch._scaled_mm` kernel.
A kernel that raises is a `TrainingError` naming the layer and GEMM, never a fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gptoss_cli import torch_private
from gptoss_cli.errors import TrainingError
from gptoss_cli.fp8.scaling import MX_BLOCK, Fp8Format, Quantized, quantize

SCALED_MM = "scaled_mm"
BLOCK_SCALED_MM = "block_scaled_mm"
DEQUANTIZE = "dequantize"
KERNELS = (SCALED_MM, BLOCK_SCALED_MM, DEQUANTIZE)

_NATIVE_ALIGN = 16  # torch._scaled_mm on CUDA: K and N multiples of 16


@dataclass(frozen=True)
class Fp8Numerics:
    """What one recipe does to a GEMM: scaling rule, formats by operand role, kernel."""

    scaling: str  # "tensor" | "row" | "mx"
    forward: Fp8Format  # inputs and weights
    gradient: Fp8Format  # output gradients
    kernel: str

    def k_align(self, device: torch.device) -> int:
        """The multiple the contraction axis is padded to."""
        align = MX_BLOCK if self.scaling == "mx" else 1
        if device.type == "cuda" and self.kernel != DEQUANTIZE:
            align = max(align, _NATIVE_ALIGN)
        return align

    def matmul(self, a: torch.Tensor, b: torch.Tensor, *, grad_operand: str | None, where: str,
               names: tuple[str, str], out_dtype: torch.dtype,
               checks: list[tuple[torch.Tensor, str]] | None = None) -> torch.Tensor:
        """`a [M, K] @ b [N, K]^T -> [M, N]` in `out_dtype`. `grad_operand` ("a" or "b") is the
        output gradient (quantised in the gradient format); `where` and `names` name the layer, the
        GEMM and the operands in errors; `checks` defers the NaN/inf checks (scaling.quantize)."""
        m, n = a.shape[0], b.shape[0]
        if m == 0 or n == 0 or a.shape[1] == 0:
            return a.new_zeros(m, n, dtype=out_dtype)
        align = self.k_align(a.device)
        a, b = _pad_last(a, align), _pad_last(b, align)
        n_align = _NATIVE_ALIGN if a.is_cuda and self.kernel == SCALED_MM else 1
        b = _pad_rows(b, n_align)
        fa = self.gradient if grad_operand == "a" else self.forward
        fb = self.gradient if grad_operand == "b" else self.forward
        qa = quantize(a.contiguous(), fa, self.scaling, f"{where} {names[0]}", checks)
        qb = quantize(b.contiguous(), fb, self.scaling, f"{where} {names[1]}", checks)
        try:
            out = run_kernel(self.kernel, qa, qb, out_dtype)
        except (RuntimeError, ValueError) as exc:  # torch raises either for an unsupported configuration
            raise TrainingError(
                f"{where}: the FP8 kernel {self.kernel} failed on a {list(a.shape)} x {list(b.shape)}^T GEMM "
                f"({qa.fmt.name} x {qb.fmt.name}): {str(exc).splitlines()[0]}",
                hint="report it with the shapes; precision.fp8_emulation=true with a CPU run checks the numerics",
            ) from None
        return out[:, :n] if out.shape[1] != n else out


def run_kernel(kernel: str, qa: Quantized, qb: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """qa [M, K], qb [N, K] (both quantised along K) -> qa @ qb^T."""
    if kernel == DEQUANTIZE:
        return (qa.dequantize() @ qb.dequantize().t()).to(out_dtype)
    if kernel == SCALED_MM:
        if qa.scaling == "row":
            scale_a, scale_b = qa.scale, qb.scale.view(1, -1)
        elif qa.scaling == "tensor":
            scale_a, scale_b = qa.scale, qb.scale
        else:
            raise ValueError(f"{kernel} takes tensorwise or rowwise scales, not {qa.scaling}")
        return torch_private.scaled_mm(qa.data, qb.data.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    if kernel == BLOCK_SCALED_MM:
        if qa.scaling != "mx":
            raise ValueError(f"{kernel} takes MX scales, not {qa.scaling}")
        # The call torchao's MX linear makes on sm100: scales as UE8M0 in the swizzled layout.
        return torch_private.scaled_mm(qa.data, qb.data.t(), swizzle_mx_scales(qa.scale).view(torch.float8_e8m0fnu),
                                       swizzle_mx_scales(qb.scale).view(torch.float8_e8m0fnu), out_dtype=out_dtype)
    raise ValueError(f"unknown FP8 kernel {kernel!r} (one of {', '.join(KERNELS)})")


def swizzle_mx_scales(scales: torch.Tensor) -> torch.Tensor:
    """`[rows, K/32]` scale bytes -> cuBLAS's block-scaling layout, flattened: rows padded to 128 and
    scale columns to 4, then each 128x4 tile stored as 32 rows of (4 row groups x 4 columns).
    (cuBLAS documentation, "1D block scaling factors layout"; torchao's `to_blocked` is the same.)"""
    rows, cols = scales.shape
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = scales.new_zeros(pr, pc)
    padded[:rows, :cols] = scales
    tiles = padded.view(pr // 128, 128, pc // 4, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1).contiguous()


def _pad_last(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-t.shape[-1]) % multiple
    return F.pad(t, (0, extra)) if extra else t


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-t.shape[0]) % multiple
    return F.pad(t, (0, 0, 0, extra)) if extra else t


__all__ = ["Fp8Numerics", "run_kernel", "swizzle_mx_scales", "SCALED_MM", "BLOCK_SCALED_MM", "DEQUANTIZE", "KERNELS"]
