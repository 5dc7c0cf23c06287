"""MXFP4 codec: GPT-OSS expert blocks/scales to dense values and back (OCP floor rule).

Layout (docs/checkpoint-layouts.md, "MXFP4"): `blocks uint8 [..., G, 16]` holds 32 E2M1 codes per
group, low nibble = element 2j, high nibble = element 2j+1; `scales uint8 [..., G]` holds one
UE8M0 exponent per group, value = code_value * 2**(scale - 127).

Decoding is two table lookups and a multiply, done directly in the output dtype: every E2M1
value times a power of two is exact in bf16 and fp32, so nothing is rounded.

Encoding follows the OCP "floor" rule: per group e = max(-127, floor(log2(amax)) - 2) (an
all-zero group gets e = -127, scale byte 0), values divided by 2**e are rounded to the nearest
E2M1 value (ties to even) and clamped to +-6. NaN and Inf are refused (`NonFiniteError`).

Round trip of any bytes (scale bytes up to 252, whose values are finite): decode then encode
gives the same values, always. It gives the same bytes when the group's largest code magnitude m
is 4 or 6, which is every group the floor rule writes (so an unchanged floor-encoded source
round-trips byte for byte), or when its scale byte is 0. Other groups come back in the floor
rule's form: the scale byte drops by 2 - floor(log2 m) (m = 3 or 2: by 1; 1.5 or 1: by 2;
0.5: by 3), stopping at 0, and the codes grow to match; an all-zero group keeps its codes
(signed zeros too) and gets scale byte 0.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32

# Midpoints between neighbouring E2M1 magnitudes; a magnitude exactly on a midpoint rounds to the
# neighbour with the even mantissa bit: down at 0.25, 1.25, 2.5, 5; up at 0.75, 1.75, 3.5.
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_ROUND_UP_TIES = torch.tensor([0.75, 1.75, 3.5])

_pair_cache: dict[torch.dtype, torch.Tensor] = {}
_scale_cache: dict[torch.dtype, torch.Tensor] = {}


def _pair_lut(dtype: torch.dtype) -> torch.Tensor:
    """[256]: byte -> (value of low nibble, value of high nibble), packed as one wider integer.

    Packing the pair into one element halves the gather work; viewed back as `dtype`, element
    2j (low nibble) comes first because the platform is little-endian.
    """
    if dtype not in _pair_cache:
        vals = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        b = torch.arange(256)
        pairs = torch.stack([vals[b & 0xF], vals[b >> 4]], dim=-1).to(dtype).contiguous()
        packed = {2: torch.int32, 4: torch.int64}[pairs.element_size()]
        _pair_cache[dtype] = pairs.view(packed).reshape(256)
    return _pair_cache[dtype]


def _scale_lut(dtype: torch.dtype) -> torch.Tensor:
    """[256]: UE8M0 byte -> 2**(byte - 127) (255 is NaN by the OCP spec)."""
    if dtype not in _scale_cache:
        lut = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - 127)
        lut[255] = float("nan")
        _scale_cache[dtype] = lut.to(dtype)
    return _scale_cache[dtype]


def decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`blocks [..., G, 16] uint8`, `scales [..., G] uint8` -> values `[..., G * 32]` in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    # index_select takes int32 indices: half the index memory of .long() and several times faster
    values = _pair_lut(dtype).index_select(0, blocks.reshape(-1).int()).view(dtype)
    values = values.reshape(*scales.shape, GROUP)
    values.mul_(_scale_lut(dtype).index_select(0, scales.reshape(-1).int()).reshape(*scales.shape, 1))
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * GROUP)


class NonFiniteError(ValueError):
    """`encode` met NaN or Inf: E2M1 codes have neither, and a NaN scale (255) would turn the whole
    group of 32 into NaN, so there is no faithful encoding. `index` is the first such element."""

    def __init__(self, value: float, index: tuple[int, ...]):
        super().__init__(f"MXFP4 cannot encode {value} at index {list(index)}: E2M1 has no NaN or Inf")
        self.value = value
        self.index = index


def encode(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values `[..., K]` (K divisible by 32) -> (`blocks [..., K/32, 16] uint8`, `scales [..., K/32] uint8`).

    Raises `NonFiniteError` for NaN or Inf input."""
    if values.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the last dimension divisible by {GROUP}, got {tuple(values.shape)}")
    lead = values.shape[:-1]
    g = values.shape[-1] // GROUP
    x = values.reshape(*lead, g, GROUP).float()
    amax = x.abs().amax(dim=-1)
    if not bool(torch.isfinite(amax).all()):  # amax propagates NaN and Inf: one check per group
        *head, group, j = (int(i) for i in (~torch.isfinite(x)).nonzero()[0])
        index = (*head, group * GROUP + j)
        raise NonFiniteError(float(values[index]), index)
    # floor(log2(amax)) exactly, from the float's exponent bits (log2 of a float32 can round up
    # just below a power of two); an all-zero group gets the smallest scale, as torchao does.
    _, exp = torch.frexp(amax)
    e = torch.where(amax > 0, exp - 1 - 2, torch.full_like(exp, -127)).clamp(-127, 127)
    scales = (e + 127).to(torch.uint8)
    q = torch.ldexp(x, -e.unsqueeze(-1))
    mag = q.abs()
    codes = torch.bucketize(mag, _MIDPOINTS.to(mag.device), right=False)
    codes += torch.isin(mag, _ROUND_UP_TIES.to(mag.device)).to(codes.dtype)
    codes.clamp_(max=7)
    codes |= torch.signbit(q).to(codes.dtype) << 3
    codes = codes.to(torch.uint8).reshape(*lead, g, GROUP // 2, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks.contiguous(), scales.contiguous()
