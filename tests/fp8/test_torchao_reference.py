"""MX blocks and the native kernel's scale layout against torchao, the independent reference (a test
dependency only): `to_mx` with cuBLAS's RCEIL scale rule, byte for byte, and `to_blocked`."""

from __future__ import annotations

import warnings

import pytest
import torch

from gptoss_cli.fp8.matmul import swizzle_mx_scales
from gptoss_cli.fp8.scaling import E4M3, E5M2, quantize

torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.utils import to_blocked


def _edge_matrix(dtype: torch.dtype) -> torch.Tensor:
    """Rows spanning 60 decades, a zero block, signed zeros, subnormal-range values and outliers."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 288, generator=g) * torch.logspace(-30, 30, 48)[:, None]
    x[0, :32] = 0.0
    x[1, :32] = -0.0
    x[2, 40] = 1e4          # one large outlier in a block of ordinary values
    x[3, :] = 2.0**-140     # a block far below the range: scale clamped to 2^-127
    x[4, 64:96] = torch.linspace(-448, 448, 32)
    return x.to(dtype)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mx_blocks_equal_torchao_to_mx_byte_for_byte(fmt, dtype):
    x = _edge_matrix(dtype)
    scale, data = torchao_mx.to_mx(x, fmt.dtype, 32, ScaleCalculationMode.RCEIL)
    q = quantize(x, fmt, "mx")
    assert torch.equal(q.scale, scale.view(torch.uint8))
    assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8))


def test_mx_dequantize_equals_torchao():
    x = _edge_matrix(torch.float32)
    mx = torchao_mx.MXTensor.to_mx(x, E4M3.dtype, 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(quantize(x, E4M3, "mx").dequantize(), mx.dequantize(torch.float32))


@pytest.mark.parametrize("rows, cols", [(90, 3), (128, 4), (300, 9)])
def test_mx_scale_swizzle_for_the_native_kernel_equals_torchao_to_blocked(rows, cols):
    scales = torch.randint(0, 255, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(swizzle_mx_scales(scales), to_blocked(scales).flatten())
