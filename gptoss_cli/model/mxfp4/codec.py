"""MXFP4 codec: GPT-OSS expert blocks/scales to dense values and back (OCP floor rule), and the QAT rounding.

One implementation for `convert --experts mxfp4` (gptoss_cli/checkpoint/formats/hf/layouts.py imports it) and for
quantisation-aware training (`round_to_mxfp4`, model/mxfp4/qat.py): the rounding the forward applies is
the export's encoder followed by its decoder, so the two cannot drift apart.

Layout (docs/checkpoint-layouts.md, "MXFP4"): `blocks uint8 [..., G, 16]` holds 32 E2M1 codes per
group, low nibble = element 2j, high nibble = element 2j+1; `scales uint8 [..., G]` holds one
UE8M0 exponent per group, value = code_value * 2**(scale - 127).

Decoding is one table lookup per byte and no arithmetic on values: a 256 x 256 table holds, for
every (scale byte, block byte), the two decoded values of that byte, computed once in float64
(exact: an E2M1 value times a power of two) and rounded to the output dtype, so the result is the
correctly rounded product, bit for bit: finite and exact for normal scales, +-inf where it
overflows, and NaN for scale 255 (the OCP spec reserves it). CPUs without native bf16 arithmetic
are no slower than those with it.

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

import threading

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32

# Midpoints between neighbouring E2M1 magnitudes; a magnitude exactly on a midpoint rounds to the
# neighbour with the even mantissa bit: down at 0.25, 1.25, 2.5, 5; up at 0.75, 1.75, 3.5.
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_ROUND_UP_TIES = torch.tensor([0.75, 1.75, 3.5])

_table_cache: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_scratch = threading.local()  # per thread: the int32 index buffer of one slice, reused
# Block bytes decoded per step. The slice's int32 indices (4 bytes per block byte, 1 MiB) stay in
# the L2 cache between being built and being used, and the per-step overhead of three torch calls
# stays small against the work. On a GPU the three calls are kernel launches, which would dominate
# small slices (a 20B MoE layer's fc1 is about 1,000 of them): there a slice is 16 MiB of blocks
# (a 64 MiB index buffer per thread).
SLICE_BYTES = 256 * 1024
DEVICE_SLICE_BYTES = 16 * 1024 * 1024


def _value_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[65536]: scale byte * 256 + block byte -> (value of low nibble, value of high nibble) of that
    byte, scaled and rounded to `dtype`, packed as one integer of twice the width.

    Packing the pair into one element halves the gather work; viewed back as `dtype`, element 2j
    (low nibble) comes first because the platform is little-endian.
    """
    key = (dtype, device)
    if key not in _table_cache:
        vals = torch.tensor(E2M1_VALUES, dtype=torch.float64)
        b = torch.arange(256)
        pairs = torch.stack([vals[b & 0xF], vals[b >> 4]], dim=-1)  # [byte, 2]
        scale = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - 127)
        table = (scale[:, None, None] * pairs).to(dtype)  # [scale, byte, 2]; exact in float64
        table[255] = float("nan")  # UE8M0 255 is NaN (OCP MX spec), whatever the code
        packed = {2: torch.int32, 4: torch.int64}[table.element_size()]
        _table_cache[key] = table.contiguous().view(packed).reshape(256 * 256).to(device)
    return _table_cache[key]


def _index_buffer(n: int, device: torch.device) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n or buf.device != device:
        buf = _scratch.buf = torch.empty(n, dtype=torch.int32, device=device)
    return buf[:n]


def decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """`blocks [..., G, 16] uint8`, `scales [..., G] uint8` -> values `[..., G * 32]` in `dtype`.

    With `out` (contiguous, that shape and dtype) the values are written into it, with no copy
    between (conversion decodes into the buffers its O_DIRECT writer writes as they are), and it is
    returned.

    Safe to call from several threads at once (each has its own index buffer); torch's gather and
    copy kernels release the GIL, so threads decode in parallel.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    table = _value_table(dtype, blocks.device)
    shape = (*scales.shape[:-1], scales.shape[-1] * GROUP)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=blocks.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous() or out.device != blocks.device:
        raise ValueError(f"MXFP4 decode into {out.dtype} {tuple(out.shape)}: needs a contiguous {dtype} {shape}")
    if out.storage_offset() % (table.element_size() // out.element_size()):
        # the pairs' wider elements cannot start mid-pair in out's storage (an odd number of values
        # before it there): decode apart, then copy
        return out.copy_(decode(blocks, scales, dtype))
    groups = scales.numel()
    b = blocks.reshape(groups, GROUP // 2)
    s = scales.reshape(groups, 1).to(torch.int32) << 8
    flat = out.view(-1).view(table.dtype)  # two values per element (see _value_table)
    slice_bytes = SLICE_BYTES if blocks.device.type == "cpu" else DEVICE_SLICE_BYTES
    step = max(1, slice_bytes // (GROUP // 2))  # groups per slice
    idx = _index_buffer(min(groups, step) * (GROUP // 2), blocks.device)
    for g0 in range(0, groups, step):
        g1 = min(groups, g0 + step)
        n = (g1 - g0) * (GROUP // 2)
        i = idx[:n].view(g1 - g0, GROUP // 2)
        i.copy_(b[g0:g1])  # the index is scale * 256 + byte, built in int32 (index_select's narrowest)
        i.add_(s[g0:g1])
        torch.index_select(table, 0, idx[:n], out=flat[g0 * (GROUP // 2) : g1 * (GROUP // 2)])
    return out


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


def round_to_mxfp4(values: torch.Tensor) -> torch.Tensor:
    """`values [..., K]` (K divisible by 32) rounded to MXFP4 along the last axis, in `values.dtype`:
    exactly `decode(*encode(values), values.dtype)`, the values `convert --experts mxfp4` writes.

    Exact in bf16 and fp32 for every scale the floor rule gives a finite input (an E2M1 value times
    2**e, e >= -127, has at most two significant bits). Raises `NonFiniteError` for NaN or Inf."""
    blocks, scales = encode(values)
    return decode(blocks, scales, values.dtype)
