"""Scaling and casting to FP8: the two formats, the three scale rules, and the guard against NaN/inf.

Numerics (docs/megatron-rules.md, "FP8 and MXFP8"):

Formats (OCP 8-bit floating point, torch's `float8_e4m3fn` / `float8_e5m2`):
  e4m3  1 sign, 4 exponent, 3 mantissa bits; max 448, smallest normal 2^-6, smallest subnormal
        2^-9; no infinities. Relative rounding error of a normal value <= 2^-4.
  e5m2  1 sign, 5 exponent, 2 mantissa bits; max 57344, smallest normal 2^-14, smallest
        subnormal 2^-16. Relative rounding error of a normal value <= 2^-3.

Rounding: round to nearest, ties to even (torch's cast), after the value was scaled in fp32.
Subnormals are kept; what lies below half the smallest subnormal becomes a (signed) zero.
Saturation: scaled values are clamped to +-max before the cast, so an overflow becomes +-max, never
NaN (e4m3) or inf (e5m2). With the scale rules below only rounding can reach the clamp.

Every operand is quantised along its last axis, which the caller makes the GEMM's contraction
axis (gptoss_cli/fp8/matmul.py), with a scale computed from the tensor itself at every call
(dynamic, "current" scaling; no amax history):
  tensor  one fp32 decode scale d = amax(|x|) / max (1 when amax = 0; at least 2^-126, so x / d
          stays finite); q = cast(clamp(x / d)), x ~ q * d.
  row     the same with one d per row: amax over the contraction axis, so each row along the
          GEMM's outer dimension has its own scale.
  mx      MX (OCP microscaling): one UE8M0 scale 2^e per 32 consecutive values along the
          contraction axis, e = ceil(log2(amax_block / max)), clamped to [-127, 127] and stored
          biased by 127 in one byte. This is cuBLAS's rule for FP8 with UE8M0 scales ("RCEIL");
          it never clips a block's largest value. The OCP default (e = floor(log2 amax) -
          emax_elem) clips block maxima in (448, 512) x 2^e to 448, the saturation in the
          backward re-quantisation that a peer hit with biased experts. A block whose exponent
          is clamped to -127 (amax <= 448 x 2^-127, all values below e4m3's range anyway) is
          cast unscaled, as torchao's `to_mx` does, so its elements are zeros.

NaN or inf in an input is a `TrainingError` naming the layer, the GEMM and the operand (casting
would turn inf into +-max for e4m3 and hide a NaN inside a block's scale); it costs one host
synchronisation per quantised operand, or one per grouped GEMM, which collects its experts' checks
(`checks`) and runs them together in order, so the error names the same expert and operand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gptoss_cli.errors import TrainingError

MX_BLOCK = 32
_MIN_NORMAL_FP32 = 2.0**-126
_E8M0_BIAS = 127


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 element format."""

    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 3)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2)

SCALINGS = ("tensor", "row", "mx")


@dataclass(frozen=True)
class Quantized:
    """An FP8 operand quantised along its last axis.

    data: fp8 `[rows, K]`; scale: the decode scale, fp32 `[]` (tensor) or `[rows, 1]` (row), or for
    mx the biased UE8M0 exponents as uint8 `[rows, K / 32]`."""

    data: torch.Tensor
    scale: torch.Tensor
    scaling: str
    fmt: Fp8Format

    def decode_scale(self) -> torch.Tensor:
        """fp32 multiplier per element group: `[]`, `[rows, 1]` or, for mx, `[rows, K / 32, 1]`."""
        if self.scaling != "mx":
            return self.scale
        return mx_scale_values(self.scale).unsqueeze(-1)

    def dequantize(self) -> torch.Tensor:
        """The fp32 values the FP8 operand stands for (exact: q x 2^e, or q x d rounded once)."""
        q = self.data.float()
        if self.scaling != "mx":
            return q * self.scale
        rows, k = q.shape
        return (q.view(rows, k // MX_BLOCK, MX_BLOCK) * self.decode_scale()).view(rows, k)


def cast_saturating(scaled: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """fp32 values already scaled into the format's range -> fp8 (clamp to +-max, round to nearest even)."""
    return scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)


def check_finite(amax: torch.Tensor, where: str) -> None:
    """Raise when an amax is NaN or inf: the operand it came from holds a non-finite value."""
    largest = float(amax.max()) if amax.numel() else 0.0  # max propagates NaN
    if not math.isfinite(largest):
        kind = "NaN" if math.isnan(largest) else "inf"
        raise TrainingError(
            f"{where} contains {kind}; an FP8 cast would hide it (inf saturates to the format's max, "
            "NaN poisons its whole scale group), so the run stops here",
            hint="the values were already non-finite before this GEMM: look at the loss and grad norm of "
                 "the steps before, lower training.lr or compare against precision.fp8_recipe=none",
        )


def check_all_finite(checks: list[tuple[torch.Tensor, str]]) -> None:
    """`check_finite` on each collected (amax, where) in order, with one host synchronisation."""
    if not checks:
        return
    largest = torch.stack([amax for amax, _ in checks]).tolist()
    for value, (amax, where) in zip(largest, checks):
        if not math.isfinite(value):
            check_finite(amax, where)


def quantize(x: torch.Tensor, fmt: Fp8Format, scaling: str, where: str = "FP8 operand",
             checks: list[tuple[torch.Tensor, str]] | None = None) -> Quantized:
    """Quantise a 2-D tensor along its last axis (see the module docstring for the rules).

    For mx the last axis must be a multiple of 32 (callers pad the contraction axis with zeros,
    which changes no product). With `checks`, the NaN/inf check is appended there for
    `check_all_finite` instead of run now."""
    if x.dim() != 2:
        raise ValueError(f"{where}: quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    x = x.float()
    if scaling == "tensor":
        amax = x.abs().amax() if x.numel() else x.new_zeros(())
        _check(amax, where, checks)
        scale = _decode_scale(amax, fmt)
        return Quantized(cast_saturating(x / scale, fmt), scale, scaling, fmt)
    if scaling == "row":
        amax = x.abs().amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros(x.shape[0], 1)
        _check(amax, where, checks)
        scale = _decode_scale(amax, fmt)
        return Quantized(cast_saturating(x / scale, fmt), scale, scaling, fmt)
    if scaling == "mx":
        rows, k = x.shape
        if k % MX_BLOCK:
            raise ValueError(f"{where}: MX needs the contraction axis padded to a multiple of {MX_BLOCK}, got {k}")
        blocks = x.view(rows, k // MX_BLOCK, MX_BLOCK)
        amax = blocks.abs().amax(dim=-1)
        _check(amax, where, checks)
        biased = mx_exponents(amax, fmt)
        # The multiplier that maps a block into range: 2^-e from its bits, or 1 for a block clamped
        # to 2^-127 (whose values are below the format's range anyway).
        rcp = torch.bitwise_left_shift(2 * _E8M0_BIAS - biased.int(), 23).view(torch.float32)
        rcp = torch.where(biased == 0, 1.0, rcp)
        data = cast_saturating(blocks * rcp.unsqueeze(-1), fmt).view(rows, k)
        return Quantized(data, biased, scaling, fmt)
    raise ValueError(f"unknown FP8 scaling {scaling!r} (one of {', '.join(SCALINGS)})")


def _check(amax: torch.Tensor, where: str, checks: list[tuple[torch.Tensor, str]] | None) -> None:
    if checks is None:
        check_finite(amax, where)
    else:  # its largest value only: max propagates NaN, as in check_finite
        checks.append((amax.max() if amax.numel() else amax.new_zeros(()), where))


def _decode_scale(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
    return scale.clamp(min=_MIN_NORMAL_FP32)


def mx_exponents(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Biased UE8M0 exponents (uint8) of the blocks with these maxima: ceil(log2(amax / max)) + 127.

    Computed exactly from frexp (amax / max = m x 2^p with m in [0.5, 1), so the ceiling of its
    log2 is p, or p - 1 when m = 0.5), not from a rounded log2."""
    descale = amax / fmt.max
    mantissa, exponent = torch.frexp(descale)
    e = exponent - (mantissa == 0.5).to(exponent.dtype)
    # amax = 0, or amax / max below fp32's range: the smallest scale
    e = torch.where(descale > 0, e, torch.full_like(e, -_E8M0_BIAS))
    return (e.clamp(-_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS).to(torch.uint8)


def mx_scale_values(biased: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> the fp32 powers of two 2^(byte - 127) they encode, built from the exponent bits
    (byte 0, 2^-127, is below fp32's normal range and comes out as 0: its block holds only zeros)."""
    return torch.bitwise_left_shift(biased.int(), 23).view(torch.float32)


__all__ = ["Fp8Format", "E4M3", "E5M2", "MX_BLOCK", "SCALINGS", "Quantized", "quantize", "cast_saturating",
           "check_finite", "check_all_finite", "mx_exponents", "mx_scale_values"]
