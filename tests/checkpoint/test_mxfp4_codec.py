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
