"""model/decode/skinny_gemm.py: the blocked few-row product equals the fp64 product of the same operands to
fp32 rounding at every output column, block edges and a short last block included, and is taken only
where it was measured to pay (bench/generate.py --gemm)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gptoss_cli.model.decode import skinny_gemm
from gptoss_cli.model.decode.skinny_gemm import blocked, skinny_linear
from tests.tolerances import reassociation_rel

# A weight over BLOCKED_MIN_BYTES whose row count is not a multiple of the block's (512 rows of 256
# fp32 values per 512 KiB): 9 blocks, the last of 37 rows.
OUT, IN = 8 * 512 + 37, 256


def _operands(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, IN, generator=g), torch.randn(OUT, IN, generator=g) * 0.05,
            torch.randn(OUT, generator=g))


@pytest.mark.parametrize("rows", [4, 8, 12])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("into_out", [False, True], ids=["new-output", "given-output"])
def test_blocked_product_equals_the_fp64_product(rows, with_bias, into_out):
    x, w, b = _operands(rows)
    assert blocked(x, w)
    bias = b if with_bias else None
    # Error model (tests/tolerances.py): each output is one fp32 dot product over IN terms (plus the
    # bias), in whatever order the kernel sums them; against fp64 that is within IN terms' rounding.
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    dest = torch.full((rows, OUT), float("nan")) if into_out else None
    got = skinny_linear(x, w, bias, out=dest)
    if into_out:
        assert got.data_ptr() == dest.data_ptr()
    err = (got.double() - want).abs().max().item()
    assert err <= reassociation_rel(IN + 1) * want.abs().max().item(), f"max |diff| {err:.3g}"
    # every column written (a block skipped would leave the NaN fill or garbage far outside the bound)
    assert torch.isfinite(got).all()


def test_only_fp32_cpu_operands_with_the_measured_rows_and_sizes_are_blocked():
    x, w, _ = _operands(8)
    assert blocked(x, w)
    assert not blocked(x[:3], w) and not blocked(torch.randn(16, IN), w)  # MKL's own blocking is as fast
    assert not blocked(x.bfloat16(), w.bfloat16())  # oneDNN: blocking measured slower
    small = w[:1024]  # 1 MiB, under BLOCKED_MIN_BYTES
    assert not blocked(x, small)
    assert torch.equal(skinny_linear(x, small), F.linear(x, small))  # the whole product, the same call


def test_thresholds_are_read_when_called(monkeypatch):
    """The generate tests lower the thresholds to run the blocked form on tiny models."""
    x, w, _ = _operands(4)
    monkeypatch.setattr(skinny_gemm, "BLOCKED_MIN_BYTES", 1 << 40)
    assert not blocked(x, w)
