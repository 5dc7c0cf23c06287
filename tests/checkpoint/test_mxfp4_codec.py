"""MXFP4: decoding per the OCP layout, the floor-rule encoder, and byte-exact round trips."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.checkpoint import mxfp4


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
