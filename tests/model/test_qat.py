"""MXFP4 QAT at the grouped-GEMM seam: the forward uses exactly the export's rounded weights, the
gradient passes straight through to the full-precision weight (STE), and delayed wgrad and FP8
compose with it.

References: the rounding is checked against the export's encoder followed by transformers' own
MXFP4 dequantiser (not our decoder); the STE against torch autograd of a plain per-expert matmul
whose weight leaf holds the rounded values."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.model.mxfp4 import codec as mxfp4
from gptoss_cli.model.gemm.grouped import WgradQueue, grouped_linear
from gptoss_cli.model.mxfp4.qat import Mxfp4QatGemm, qat_gemms, rounded_weight
from tests.tolerances import reassociation_rel

E, OUT, IN = 3, 48, 96  # IN: three MXFP4 blocks of 32 along the contraction axis


def _operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(E, OUT, IN, generator=g) * 0.02).requires_grad_()
    bias = (torch.randn(E, OUT, generator=g) * 0.01).requires_grad_()
    counts = torch.tensor([5, 0, 7])  # an expert without rows too
    x = torch.randn(int(counts.sum()), IN, generator=g).requires_grad_()
    dy = torch.randn(int(counts.sum()), OUT, generator=g)
    return x, weight, bias, counts, dy


def _reference(x, weight, bias, counts, dy):
    """Plain autograd with the rounded weight as its own leaf: y_e = x_e Wq_e^T + b_e."""
    wq = rounded_weight(weight).clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    br = bias.detach().clone().requires_grad_()
    y = torch.cat([xe @ wq[e].t() + br[e] for e, xe in enumerate(torch.split(xr, counts.tolist()))])
    y.backward(dy)
    return y.detach(), xr.grad, wq.grad, br.grad


REL = reassociation_rel(IN)  # a grouped GEMM against per-expert matmuls: the order of IN-term sums


def _close(a, b):
    assert (a - b).abs().max().item() <= REL * b.abs().max().item() + 1e-30


def test_rounding_is_the_exports_encoder_read_back_by_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(E, OUT, IN, generator=torch.Generator().manual_seed(1)) * 0.05
    blocks, scales = mxfp4.encode(w)  # what `convert --experts mxfp4` writes, [E, OUT, IN/32, 16]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(rounded_weight(w), theirs)
    assert not torch.equal(rounded_weight(w), w)  # it does round
    # blocks run along the last (contraction) axis: rounding a row alone gives the same row
    assert torch.equal(rounded_weight(w[:, :1]), rounded_weight(w)[:, :1])
    # bf16 weights round to the same values, exactly representable in bf16
    assert torch.equal(rounded_weight(w.bfloat16()).float(), rounded_weight(w.bfloat16().float()))


def test_ste_forward_uses_rounded_weights_and_gradients_pass_straight_through():
    x, weight, bias, counts, dy = _operands()
    y = grouped_linear(x, weight, bias, counts, gemm=Mxfp4QatGemm())
    y.backward(dy)
    y_ref, dx_ref, dwq_ref, db_ref = _reference(x, weight, bias, counts, dy)
    _close(y.detach(), y_ref)
    _close(x.grad, dx_ref)  # dgrad through the rounded weight
    _close(weight.grad, dwq_ref)  # dL/dW := dL/dQ(W): the straight-through estimator
    _close(bias.grad, db_ref)
    # and the forward is not the full-precision one
    y_full = grouped_linear(x.detach(), weight.detach(), bias.detach(), counts)
    assert (y.detach() - y_full).abs().max() > 100 * REL * y_full.abs().max()


def test_ste_with_delayed_wgrad_queues_the_same_gradients():
    x, weight, bias, counts, dy = _operands(2)
    queue = WgradQueue()
    y = grouped_linear(x, weight, bias, counts, gemm=Mxfp4QatGemm(), wgrad_queue=queue)
    y.backward(dy)
    assert weight.grad is None and len(queue) == 1
    queue.execute()
    _, dx_ref, dwq_ref, db_ref = _reference(x, weight, bias, counts, dy)
    _close(x.grad, dx_ref)
    _close(weight.grad, dwq_ref)
    _close(bias.grad, db_ref)


def test_no_grad_forward_uses_the_rounded_weights_too():
    x, weight, bias, counts, dy = _operands(3)
    with torch.no_grad():
        y = grouped_linear(x, weight, bias, counts, gemm=Mxfp4QatGemm())
    _close(y, _reference(x, weight, bias, counts, dy)[0])


def test_mxfp8_forward_quantisation_keeps_mxfp4_rounded_weights_exact():
    """With fp8_recipe=mxfp8 the rounded weights enter the MXFP8 fprop GEMM unchanged: every MXFP4
    value is an E4M3 value under the MXFP8 scale of its own block of 32 along the same axis."""
    from gptoss_cli.fp8.scaling import E4M3, quantize

    w = rounded_weight(torch.randn(E, OUT, IN, generator=torch.Generator().manual_seed(4)) * 0.05)
    q = quantize(w.reshape(-1, IN), E4M3, "mx")
    assert torch.equal(q.dequantize().reshape(w.shape), w)


def test_qat_gemms_wraps_the_inner_gemm_and_refuses_unknown_formats():
    from gptoss_cli.model.gemm.grouped import GroupedGemm

    inner = GroupedGemm()
    assert qat_gemms("none", None) is None
    gemm = qat_gemms("mxfp4", lambda name: inner)("decoder.layers.1.mlp.experts.linear_fc1")
    assert isinstance(gemm, Mxfp4QatGemm) and gemm.inner is inner
    with pytest.raises(ValueError, match="mxfp8"):
        qat_gemms("mxfp8", None)
    with pytest.raises(ValueError, match="divisible by 32"):
        rounded_weight(torch.zeros(1, 4, 48))
