"""FP8 scaling and casting (gptoss_cli/fp8/scaling.py) against hand-computed bytes and scales."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.errors import TrainingError
from gptoss_cli.fp8.scaling import E4M3, E5M2, cast_saturating, quantize


def _bytes(q) -> list[int]:
    return q.data.view(torch.uint8).flatten().tolist()


# --- formats: rounding, subnormals, saturation, signed zero ------------------------------------------
# e4m3 byte = s eeee mmm (bias 7), e5m2 byte = s eeeee mm (bias 15); hand-encoded below.
@pytest.mark.parametrize("value, byte", [
    (448.0, 0x7E),            # 1.75 x 2^8: the largest e4m3 value
    (-448.0, 0xFE),
    (1.0, 0x38),              # 2^0: exponent field 7
    (1.125, 0x39),            # one mantissa step
    (1.0625, 0x38),           # halfway between 1 and 1.125: ties to even (mantissa 000)
    (1.1875, 0x3A),           # halfway between 1.125 and 1.25: ties to even (mantissa 010)
    (2.0**-6, 0x08),          # smallest normal
    (2.0**-9, 0x01),          # smallest subnormal
    (3 * 2.0**-10, 0x02),     # 1.5 x smallest subnormal: tie, rounds to the even 2 x 2^-9
    (2.0**-10, 0x00),         # half the smallest subnormal: tie, rounds to the even 0
    (-(2.0**-11), 0x80),      # below half the smallest subnormal: a negative zero keeps its sign
    (-0.0, 0x80),
    (0.0, 0x00),
    (500.0, 0x7E),            # saturates to 448 (the raw cast would be NaN in older torch)
    (-1e6, 0xFE),
])
def test_e4m3_cast_rounds_to_nearest_even_keeps_subnormals_and_saturates(value, byte):
    q = cast_saturating(torch.tensor([value]), E4M3)
    assert q.view(torch.uint8).item() == byte


@pytest.mark.parametrize("value, byte", [
    (57344.0, 0x7B),          # 1.75 x 2^15: the largest e5m2 value
    (-57344.0, 0xFB),
    (1.0, 0x3C),              # exponent field 15
    (2.0**-14, 0x04),         # smallest normal
    (2.0**-16, 0x01),         # smallest subnormal
    (1e6, 0x7B),              # saturates to 57344, not inf (0x7C)
    (-1e6, 0xFB),
    (-0.0, 0x80),
])
def test_e5m2_cast_saturates_at_57344_instead_of_inf(value, byte):
    assert cast_saturating(torch.tensor([value]), E5M2).view(torch.uint8).item() == byte


# --- tensorwise and rowwise scales ------------------------------------------------------------------
def test_tensorwise_scale_maps_the_largest_magnitude_to_the_format_max():
    # amax 3.5 -> decode scale 3.5 / 448 = 2^-7 exactly; x / d = x * 128.
    q = quantize(torch.tensor([[1.0, -2.0, 0.5, 3.5], [0.0, -0.0, -3.5, 0.25]]), E4M3, "tensor")
    assert q.scale.item() == 2.0**-7
    #  128 = 2^7 -> 0x70; -256 = -2^8 -> 0xF8; 64 = 2^6 -> 0x68; 448 -> 0x7E; 32 = 2^5 -> 0x60
    assert _bytes(q) == [0x70, 0xF8, 0x68, 0x7E, 0x00, 0x80, 0xFE, 0x60]
    assert torch.equal(q.dequantize(), torch.tensor([[1.0, -2.0, 0.5, 3.5], [0.0, -0.0, -3.5, 0.25]]))


def test_tensorwise_e5m2_scale_uses_57344():
    q = quantize(torch.tensor([[7.0, -1.0]]), E5M2, "tensor")
    assert q.scale.item() == pytest.approx(7.0 / 57344.0, rel=2**-24)
    assert _bytes(q)[0] == 0x7B  # the largest magnitude lands exactly on the max


def test_all_zero_tensor_gets_scale_one_and_zero_bytes():
    q = quantize(torch.zeros(2, 3), E4M3, "tensor")
    assert q.scale.item() == 1.0 and _bytes(q) == [0] * 6


def test_rowwise_scales_each_row_by_its_own_amax():
    q = quantize(torch.tensor([[1.0, -7.0], [0.5, 0.25], [0.0, 0.0]]), E4M3, "row")
    assert q.scale.shape == (3, 1)
    assert q.scale.flatten().tolist() == pytest.approx([7 / 448, 0.5 / 448, 1.0], rel=2**-24)
    # row 0: -7 -> -448 (0xFE), 1 -> 64 (0x68); row 1: 0.5 -> 448, 0.25 -> 224 = 1.75 x 2^7 (0x76)
    assert _bytes(q) == [0x68, 0xFE, 0x7E, 0x76, 0x00, 0x00]


# --- MX -----------------------------------------------------------------------------------------
def test_mx_scale_is_the_power_of_two_ceiling_of_amax_over_max():
    x = torch.zeros(3, 64)
    x[0, 0] = 448.0      # amax / 448 = 1 = 2^0 exactly: e = 0 -> byte 127, no rounding up
    x[0, 32] = 449.0     # just above: e = ceil(log2(449/448)) = 1 -> byte 128
    x[1, 0] = 1.0        # 1/448 in (2^-9, 2^-8]: e = -8 -> byte 119
    x[1, 33] = -3.0      # 3/448 in (2^-8, 2^-7]: e = -7 -> byte 120
    q = quantize(x, E4M3, "mx")
    assert q.scale.tolist() == [[127, 128], [119, 120], [0, 0]]  # an all-zero block: byte 0
    assert q.data.view(torch.uint8)[0, 32].item() == 0x76       # 449 / 2 = 224.5 -> 224 = 1.75 x 2^7


def test_mx_block_with_one_outlier_loses_only_its_own_small_values():
    x = torch.full((1, 64), 0.001)
    x[0, 5] = 1000.0
    q = quantize(x, E4M3, "mx")
    deq = q.dequantize()
    # block 0: e = ceil(log2(1000 / 448)) = 2; block 1: e = ceil(log2(0.001 / 448)) = -18
    assert q.scale.tolist() == [[127 + 2, 127 - 18]]
    assert deq[0, 5].item() == 1024.0  # 1000 / 4 = 250 rounds to 256 in e4m3
    # 0.001 / 4 is below half of e4m3's smallest subnormal (2^-10): the outlier's block flushes it
    assert torch.all(deq[0, :5] == 0) and torch.all(deq[0, 6:32] == 0)
    # the next block keeps its values to e4m3 precision: 0.001 x 2^18 = 262.1 -> 256
    assert torch.all(deq[0, 32:] == 256 * 2.0**-18)


def test_nan_or_inf_in_an_operand_is_an_error_naming_it():
    for bad, kind in ((float("nan"), "NaN"), (float("inf"), "inf"), (float("-inf"), "inf")):
        x = torch.ones(2, 32)
        x[1, 7] = bad
        for scaling in ("tensor", "row", "mx"):
            with pytest.raises(TrainingError, match=f"layers.3.mlp fprop input contains {kind}"):
                quantize(x, E4M3, scaling, "layers.3.mlp fprop input")
