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
would turn inf into +-max for e4m3 and hide a NaN inside a block's scale). Checked at once it costs
one host synchronisation per quantised operand, or one per grouped GEMM, which collects its
experts' checks (`checks`) and runs them together in order, so the error names the same expert and
operand; in training the checks are recorded on the device and read once per step (fp8/guard.py).

The math of each scaling is a pure function of the tensor (`tensor_math`, `row_math`, `mx_math`),
which fp8/fused.py compiles into single-pass kernels on a GPU where they equal it bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from gptoss_cli.errors import TrainingError
from gptoss_cli.fp8 import fused

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
    return cast_saturating_math(scaled, fmt.max, fmt.dtype)


def check_finite(amax: torch.Tensor, where: str) -> None:
    """Raise when an amax is NaN or inf: the operand it came from holds a non-finite value."""
    largest = float(amax.max()) if amax.numel() else 0.0  # max propagates NaN
    if not math.isfinite(largest):
        raise nonfinite_error(where, largest)


def nonfinite_error(where: str, value: float, when: str = "") -> TrainingError:
    """The error for an operand whose largest magnitude is `value` (NaN or inf); `when` says when it
    was found, if not at the GEMM itself."""
    kind = "NaN" if math.isnan(value) else "inf"
    return TrainingError(
        f"{where} contains {kind}; an FP8 cast would hide it (inf saturates to the format's max, "
        f"NaN poisons its whole scale group), so the run stops here{when}",
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


class Checks(Protocol):
    """Where deferred NaN/inf checks go (fp8/guard.py's `NonFiniteGuard`): `record(peak, where)`."""

    def record(self, peak: torch.Tensor, where: str) -> None: ...


def tensor_math(x: torch.Tensor, fmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Tensorwise quantisation of a non-empty 2-D tensor: (fp8 data, decode scale [], amax [])."""
    x = x.float()
    amax = x.abs().amax()
    scale = decode_scale(amax, fmax)
    return cast_saturating_math(x / scale, fmax, dtype), scale, amax


def row_math(x: torch.Tensor, fmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Rowwise quantisation of a 2-D tensor with columns: (fp8 data, decode scales [rows, 1], amax [rows, 1])."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = decode_scale(amax, fmax)
    return cast_saturating_math(x / scale, fmax, dtype), scale, amax


def mx_math(x: torch.Tensor, fmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """MX quantisation of a 2-D tensor whose last axis is a multiple of 32: (fp8 data, biased
    UE8M0 exponents uint8 [rows, K / 32], amax per block)."""
    x = x.float()
    rows, k = x.shape
    blocks = x.view(rows, k // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    biased = mx_exponents_math(amax, fmax)
    # The multiplier that maps a block into range: 2^-e from its bits, or 1 for a block clamped
    # to 2^-127 (whose values are below the format's range anyway).
    rcp = torch.bitwise_left_shift(2 * _E8M0_BIAS - biased.int(), 23).view(torch.float32)
    rcp = torch.where(biased == 0, 1.0, rcp)
    data = cast_saturating_math(blocks * rcp.unsqueeze(-1), fmax, dtype).view(rows, k)
    return data, biased, amax


_MATH = {"tensor": tensor_math, "row": row_math, "mx": mx_math}


def quantize(x: torch.Tensor, fmt: Fp8Format, scaling: str, where: str = "FP8 operand",
             checks: list[tuple[torch.Tensor, str]] | Checks | None = None) -> Quantized:
    """Quantise a 2-D tensor along its last axis (see the module docstring for the rules).

    For mx the last axis must be a multiple of 32 (callers pad the contraction axis with zeros,
    which changes no product). The NaN/inf check runs at once (one host synchronisation), or is
    appended to a `checks` list for `check_all_finite`, or recorded in a `Checks` object (the
    training step's device flag, fp8/guard.py). The math runs as one compiled kernel where
    fp8/fused.py found that equal to the eager ops bit for bit."""
    if x.dim() != 2:
        raise ValueError(f"{where}: quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    if scaling not in _MATH:
        raise ValueError(f"unknown FP8 scaling {scaling!r} (one of {', '.join(SCALINGS)})")
    if scaling == "mx" and x.shape[1] % MX_BLOCK:
        raise ValueError(f"{where}: MX needs the contraction axis padded to a multiple of {MX_BLOCK}, got {x.shape[1]}")
    if x.numel() == 0:  # nothing to scale: the scale rules' empty cases, eagerly
        x = x.float()
        if scaling == "mx":
            data, scale, amax = mx_math(x, fmt.max, fmt.dtype)
        else:
            amax = x.new_zeros(()) if scaling == "tensor" else x.new_zeros(x.shape[0], 1)
            scale = decode_scale(amax, fmt.max)
            data = cast_saturating_math(x, fmt.max, fmt.dtype)
    else:
        data, scale, amax = fused.kernel(_MATH[scaling], x.device)(x, fmt.max, fmt.dtype)
    _check(amax, where, checks)
    return Quantized(data, scale, scaling, fmt)


def _check(amax: torch.Tensor, where: str, checks: list[tuple[torch.Tensor, str]] | Checks | None) -> None:
    if checks is None:
        check_finite(amax, where)
        return
    peak = amax.max() if amax.numel() else amax.new_zeros(())  # max propagates NaN, as in check_finite
    if isinstance(checks, list):
        checks.append((peak, where))
    else:
        checks.record(peak, where)


def decode_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """The fp32 decode scale of a group with this amax: amax / max, 1 for amax 0, at least 2^-126."""
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    return scale.clamp(min=_MIN_NORMAL_FP32)


def cast_saturating_math(scaled: torch.Tensor, fmax: float, dtype: torch.dtype) -> torch.Tensor:
    return scaled.clamp(-fmax, fmax).to(dtype)


def mx_exponents_math(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """Biased UE8M0 exponents (uint8) of the blocks with these maxima: ceil(log2(amax / fmax)) + 127.

    Computed exactly from frexp (amax / fmax = m x 2^p with m in [0.5, 1), so the ceiling of its
    log2 is p, or p - 1 when m = 0.5), not from a rounded log2."""
    descale = amax / fmax
    mantissa, exponent = torch.frexp(descale)
    e = exponent - (mantissa == 0.5).to(exponent.dtype)
    # amax = 0, or amax / max below fp32's range: the smallest scale
    e = torch.where(descale > 0, e, torch.full_like(e, -_E8M0_BIAS))
    return (e.clamp(-_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS).to(torch.uint8)


def mx_scale_values(biased: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> the fp32 powers of two 2^(byte - 127) they encode, built from the exponent bits
    (byte 0, 2^-127, is below fp32's normal range and comes out as 0: its block holds only zeros)."""
    return torch.bitwise_left_shift(biased.int(), 23).view(torch.float32)


def _probe_args(device: torch.device) -> list[tuple]:
    """What fp8/fused.py checks the compiled quantisers on: both formats, fp32 and bf16 inputs."""
    x = fused.edge_values(device)
    return [(x, E4M3.max, E4M3.dtype), (x, E5M2.max, E5M2.dtype), (x.to(torch.bfloat16), E4M3.max, E4M3.dtype)]


for _fn in (tensor_math, row_math, mx_math):
    fused.register(_fn, _probe_args)


__all__ = ["Fp8Format", "E4M3", "E5M2", "MX_BLOCK", "SCALINGS", "Quantized", "quantize", "cast_saturating",
           "check_finite", "check_all_finite", "nonfinite_error", "Checks", "mx_scale_values",
           "decode_scale", "tensor_math", "row_math", "mx_math"]
