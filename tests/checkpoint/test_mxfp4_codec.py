"""MXFP4: decoding per the OCP layout, the floor-rule encoder, and byte-exact round trips."""

from __future__ import annotations

import math

import pytest
import torch

from gptoss_cli.model.mxfp4 import codec as mxfp4


def test_decode_reads_low_nibble_first_and_applies_the_scale():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x7 | (0xA << 4)  # element 0 = code 7 (6.0), element 1 = code 10 (-1.0)
    blocks[0, 1] = 0x1 | (0xF << 4)  # element 2 = 0.5, element 3 = -6.0
    scales = torch.tensor([128], dtype=torch.uint8)  # 2**(128 - 127) = 2
    out = mxfp4.decode(blocks, scales, torch.float32)
    assert out.shape == (32,)
    assert out[:4].tolist() == [12.0, -2.0, 1.0, -12.0]
    assert out[4:].abs().sum() == 0


def test_decode_matches_transformers_dequantizer():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 134, (3, 8, 2), dtype=torch.uint8, generator=g)
    ours = mxfp4.decode(blocks, scales, torch.bfloat16)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, in, out]
    assert torch.equal(ours, theirs.transpose(1, 2))


def _every_scale_and_byte() -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [4, 64, 16, 16] and scales [4, 64, 16]: row (e, o) has scale byte 64e + o in all its
    groups, and its 16 groups x 16 bytes are the 256 byte values, so every (scale, byte) pair occurs."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).expand(4, 64, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).reshape(4, 64, 1).expand(4, 64, 16).contiguous()
    return blocks, scales


def _decode_with_multiply(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The decoder before the scale was folded into the table: E2M1 lookup, times 2**(scale - 127)."""
    values = torch.tensor(mxfp4.E2M1_VALUES, dtype=dtype)
    pow2 = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - 127).to(dtype)
    pow2[255] = float("nan")
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).long()  # low nibble first
    out = values[codes].reshape(*scales.shape, 32) * pow2[scales.long()].unsqueeze(-1)
    return out.reshape(*scales.shape[:-1], -1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_is_bit_identical_to_transformers_and_to_multiplying_for_every_scale_and_byte(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _every_scale_and_byte()
    ours = mxfp4.decode(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)  # [E, in, out] -> [E, out, in]
    product = _decode_with_multiply(blocks, scales, dtype)
    finite_scale = scales[..., :1].expand(4, 64, 512) != 255  # per value: its group's scale byte
    # scales 0..254: the exact product in `dtype`, signed zeros, subnormals (0.5 * 2**-127 is below
    # the smallest normal, 2**-126) and +-inf where it overflows (2 * 2**127) included
    assert torch.equal(_bits(ours)[finite_scale], _bits(theirs)[finite_scale])
    assert torch.equal(_bits(ours)[finite_scale], _bits(product)[finite_scale])
    finite = ours[finite_scale].float()
    assert torch.isinf(finite).any() and ((finite != 0) & (finite.abs() < 2.0**-126)).any()
    # scale 255 is NaN by the OCP MX spec (transformers computes 2**128 instead)
    assert torch.isnan(ours[~finite_scale]).all() and torch.isnan(product[~finite_scale]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_of_random_blocks_across_slices_matches_transformers(dtype, monkeypatch):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    # 7 groups per slice: the 3 x 11 x 5 groups end in a partial slice, and slices straddle rows
    monkeypatch.setattr(mxfp4, "SLICE_BYTES", 7 * 16)
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 11, 5, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (3, 11, 5), dtype=torch.uint8, generator=g)
    ours = mxfp4.decode(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
    assert torch.equal(_bits(ours), _bits(theirs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("values_before", [0, 1])
def test_decode_into_a_given_tensor_writes_the_values_there(dtype, values_before, monkeypatch):
    """Conversion decodes into the buffers its writer writes from: `out` gets the values, at any place
    in its storage (one value before it: out's pairs straddle the table's wider elements)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    monkeypatch.setattr(mxfp4, "SLICE_BYTES", 7 * 16)
    g = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (2, 12, 5, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (2, 12, 5), dtype=torch.uint8, generator=g)
    gate_blocks, gate_scales = blocks[:, 0::2], scales[:, 0::2]  # every other row, as the gate rows are
    size = torch.empty((), dtype=dtype).element_size()
    offset = values_before * size
    storage = torch.full((offset + 2 * 6 * 160 * size,), 7, dtype=torch.uint8)
    out = storage[offset:].view(dtype).view(2, 6, 160)
    assert mxfp4.decode(gate_blocks, gate_scales, dtype, out=out) is out
    theirs = convert_moe_packed_tensors(gate_blocks.contiguous(), gate_scales.contiguous(), dtype=dtype).transpose(1, 2)
    assert torch.equal(_bits(out), _bits(theirs))
    assert storage[:offset].eq(7).all()  # nothing written before it
    with pytest.raises(ValueError, match="needs a contiguous"):
        mxfp4.decode(blocks, scales, dtype, out=torch.empty(2, 12, 161, dtype=dtype))


def test_threads_decoding_at_once_each_get_their_own_result(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(mxfp4, "SLICE_BYTES", 16 * 1024)  # 23 slices per call: many chances to interleave
    g = torch.Generator().manual_seed(4)
    work = [
        (torch.randint(0, 256, (256, 90, 16), dtype=torch.uint8, generator=g),
         torch.randint(100, 140, (256, 90), dtype=torch.uint8, generator=g))
        for _ in range(8)
    ]
    expected = [_decode_with_multiply(b, s, torch.bfloat16) for b, s in work]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(2):
            got = list(pool.map(lambda bs: mxfp4.decode(*bs), work))
            assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, expected))


@pytest.mark.parametrize(
    "value, code",
    [(0.25, 0x0), (0.75, 0x2), (1.25, 0x2), (1.75, 0x4), (2.5, 0x4), (3.5, 0x6), (5.0, 0x6), (5.1, 0x7), (-3.0, 0xD)],
)
def test_encoder_rounds_to_nearest_with_ties_to_even(value, code):
    # 6.0 in element 0 pins the group's scale to 2**0 (floor(log2 6) - 2 = 0)
    x = torch.zeros(32)
    x[0], x[2] = 6.0, value
    blocks, scales = mxfp4.encode(x)
    assert scales.tolist() == [127]
    assert int(blocks[0, 1]) & 0xF == code


def test_encoder_uses_the_floor_scale_and_clamps_to_six():
    x = torch.zeros(32)
    x[0] = 7.9  # floor(log2 7.9) - 2 = 0, and 7.9 clamps to the largest code, 6
    blocks, scales = mxfp4.encode(x)
    assert scales.tolist() == [127]
    assert int(blocks[0, 0]) & 0xF == 0x7
    x[0] = 0.02  # floor(log2 0.02) = -6 -> e = -8
    assert mxfp4.encode(x)[1].tolist() == [127 - 8]


def test_reencoding_decoded_values_gives_identical_bytes():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(5, 7, 96, generator=g) * 0.03
    blocks, scales = mxfp4.encode(values)
    for dtype in (torch.bfloat16, torch.float32):
        decoded = mxfp4.decode(blocks, scales, dtype)
        b2, s2 = mxfp4.encode(decoded)
        assert torch.equal(b2, blocks) and torch.equal(s2, scales)
        assert torch.equal(mxfp4.decode(b2, s2, dtype), decoded)


# --- any bytes, not only our encoder's: what a decode -> encode round trip keeps ----------------
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 codes 0..7; bit 3 is the sign


def floor_form(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes the OCP floor rule gives for the values these bytes decode to, worked out group by
    group on the codes (no floats, no codec): with m the group's largest code magnitude, the scale
    byte becomes max(0, s + floor(log2 m) - 2) and every magnitude grows by the same power of two
    (exact: no E2M1 magnitude times 2**(2 - floor(log2 m)) leaves the table); an all-zero group gets
    scale byte 0 and keeps its codes."""
    blocks, scales = blocks.clone(), scales.clone()
    flat_b, flat_s = blocks.reshape(-1, 16), scales.reshape(-1)
    for g in range(flat_s.numel()):
        codes = [c for byte in flat_b[g].tolist() for c in (byte & 0xF, byte >> 4)]
        m = max(MAGNITUDES[c & 7] for c in codes)
        s = int(flat_s[g])
        if m == 0:
            flat_s[g] = 0
            continue
        new_s = max(0, s + math.floor(math.log2(m)) - 2)
        codes = [(c & 8) | MAGNITUDES.index(MAGNITUDES[c & 7] * 2 ** (s - new_s)) for c in codes]
        flat_s[g] = new_s
        flat_b[g] = torch.tensor([codes[2 * j] | codes[2 * j + 1] << 4 for j in range(16)], dtype=torch.uint8)
    return blocks, scales


def random_bytes(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random blocks (every byte value) and scale bytes 0..252 (the largest whose values are
    finite in fp32 and bf16: 6 * 2**(253 - 127) overflows), with a few groups pinned to the cases the
    rule singles out: all codes +-0, scale byte 0, the top scale byte."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 253, shape, dtype=torch.uint8, generator=g)
    flat_b, flat_s = blocks.reshape(-1, 16), scales.reshape(-1)
    flat_b[0], flat_s[0] = 0x00, 77  # +0 everywhere, a non-zero scale
    flat_b[1], flat_s[1] = 0x88, 130  # -0 everywhere
    flat_b[2] &= 0x33  # magnitudes <= 1.5 ...
    flat_s[2] = 0  # ... at the smallest scale: the floor rule cannot lower it further
    flat_b[3] = 0x11  # largest magnitude 0.5: the scale drops by 3
    flat_s[4] = 252
    return blocks, scales


def largest_magnitude(blocks: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([blocks & 0x7, (blocks >> 4) & 0x7], dim=-1)
    return torch.tensor(MAGNITUDES)[codes.long()].amax(dim=(-1, -2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoded_random_bytes_reencode_to_the_floor_form(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_bytes((3, 16, 8), seed=3)
    values = mxfp4.decode(blocks, scales, dtype)
    b2, s2 = mxfp4.encode(values)
    want_b, want_s = floor_form(blocks, scales)
    assert torch.equal(s2, want_s) and torch.equal(b2, want_b)
    # The same values, decoded by transformers' own dequantiser (signed zeros included).
    again = convert_moe_packed_tensors(b2, s2, dtype=dtype).transpose(1, 2)
    assert torch.equal(again, values) and torch.equal(torch.signbit(again), torch.signbit(values))


def test_bytes_survive_exactly_when_the_largest_code_is_4_or_6_or_the_scale_is_0():
    blocks, scales = random_bytes((3, 16, 8), seed=4)
    b2, s2 = mxfp4.encode(mxfp4.decode(blocks, scales, torch.float32))
    same = (b2 == blocks).all(dim=-1) & (s2 == scales)
    m = largest_magnitude(blocks)
    assert torch.equal(same, (m >= 4) | (scales == 0))
    assert same.any() and not same.all()  # both kinds occur in the sample


# --- encoder edges, hand-computed ---------------------------------------------------------------
def _one(value: float, second: float = 0.0) -> tuple[int, int, int]:
    """(scale byte, code of element 0, code of element 1) for a group holding `value`, `second`, zeros."""
    x = torch.zeros(32)
    x[0], x[1] = value, second
    blocks, scales = mxfp4.encode(x)
    return int(scales[0]), int(blocks[0, 0]) & 0xF, int(blocks[0, 0]) >> 4


def test_amax_exactly_a_power_of_two_is_code_4_at_scale_floor_log2_minus_2():
    assert _one(8.0, 1.0) == (127 + 1, 0x6, 0x1)  # 8 = 4 * 2**1; 1 / 2 = 0.5
    assert _one(1.0, -0.375) == (127 - 2, 0x6, 0xB)  # 1 = 4 * 2**-2; -0.375 * 4 = -1.5
    assert _one(2.0 ** -3) == (127 - 5, 0x6, 0x0)


def test_amax_just_below_a_power_of_two_keeps_the_lower_scale_and_clamps_to_6():
    below_8 = torch.nextafter(torch.tensor(8.0), torch.tensor(0.0)).item()  # 7.9999995
    below_1 = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()  # 0.99999994
    # float32 log2 rounds both up to the power of two; floor(log2) is 2 and -1
    assert _one(below_8) == (127, 0x7, 0x0)
    assert _one(below_1) == (127 - 3, 0x7, 0x0)


def test_all_zero_groups_get_scale_byte_0_and_keep_the_sign_of_zero():
    blocks, scales = mxfp4.encode(torch.tensor([0.0] * 32 + [-0.0] * 32))
    assert scales.tolist() == [0, 0]
    assert blocks[0].tolist() == [0x00] * 16 and blocks[1].tolist() == [0x88] * 16


def test_tiny_groups_clamp_the_scale_at_byte_0():
    assert _one(2.0 ** -125) == (0, 0x6, 0x0)  # e = -127 exactly: 4 * 2**-127
    assert _one(2.0 ** -126) == (0, 0x4, 0x0)  # e would be -128: clamped, 2**-126 = 2.0 * 2**-127
    assert _one(2.0 ** -149) == (0, 0x0, 0x0)  # the smallest float32 subnormal is 2**-22 of the scale: 0


def test_the_largest_float32_uses_scale_byte_252():
    # floor(log2(3.4e38)) = 127, e = 125: a finite float32 never reaches the clamp at e = 127
    assert _one(torch.finfo(torch.float32).max) == (127 + 125, 0x7, 0x0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 1e39])
def test_non_finite_input_is_refused_naming_the_element(bad):
    x = torch.zeros(2, 3, 64, dtype=torch.float64)
    x[1, 2, 40] = bad  # 1e39 is finite in float64 but not in float32
    with pytest.raises(mxfp4.NonFiniteError) as info:
        mxfp4.encode(x)
    assert info.value.index == (1, 2, 40)
    assert "at index [1, 2, 40]" in str(info.value)


# --- against torchao's MX quantiser ---------------------------------------------------------------
def test_encoder_gives_torchaos_floor_bytes_over_the_exponent_range():
    """torchao's `to_mx` (float4_e2m1fn_x2, block 32, FLOOR) is an independent implementation of the
    same rule. Group magnitudes span 2**-100 .. 2**100. Below 2**-125 the two differ on purpose:
    torchao divides by at least 2**-126 (its fp32 minimum normal) where scale byte 0 means 2**-127,
    so its codes there decode to half the input; ours decode back exactly (tested above)."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    g = torch.Generator().manual_seed(5)
    exps = torch.randint(-100, 101, (64, 8, 1), generator=g).float()
    for dtype in (torch.float32, torch.bfloat16):
        values = (torch.randn(64, 8, 32, generator=g) * torch.exp2(exps)).reshape(64, 256).to(dtype)
        values[0, :32] = 0.0
        scale, data = mx.to_mx(values, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
        blocks, scales = mxfp4.encode(values)
        assert torch.equal(scales, scale.view(torch.uint8).reshape(scales.shape))
        assert torch.equal(blocks, data.view(torch.uint8).reshape(blocks.shape))
