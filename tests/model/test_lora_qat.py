"""LoRA under MXFP4 QAT: the expert GEMMs compute with Q(W + s B A), the merged weight rounded (what the
merged MXFP4 export holds), with the straight-through estimator's gradients.

Reference: float64 autograd of x @ (M + (Q(M) - M).detach())^T + b with M = W + s B @ A, the rounding
Q by torchao's MX quantiser (FLOOR scale rule, an implementation independent of ours), so the
adapters' gradients are the ordinary low-rank ones and dx = dy @ Q(M). The old behaviour (Q(W) + the
unrounded low-rank path) fails every check below: its forward and dx use Q(W) + s B A instead. With
the frozen experts stored in MXFP4 (lora.base_experts=mxfp4) W is the decoded blocks/scales."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gptoss_cli.model.gemm.grouped import WgradQueue, grouped_linear
from gptoss_cli.model.lora import ExpertLoraAdapter, LoraSettings, merged_weight
from gptoss_cli.model.moe import ExpertLinear
from gptoss_cli.model.mxfp4.experts import Mxfp4ExpertLinear, Mxfp4WeightSlot
from gptoss_cli.model.mxfp4.qat import Mxfp4QatGemm, rounded_weight
from tests.tolerances import reassociation_rel

torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")

E, OUT, IN, RANK, ALPHA = 3, 48, 96, 4, 8.0  # IN: three MXFP4 blocks along the contraction axis
COUNTS = torch.tensor([5, 0, 7])  # an expert without rows too
N = int(COUNTS.sum())


def torchao_round(w: torch.Tensor) -> torch.Tensor:
    """w [..., K] rounded to MXFP4 along K by torchao (OCP floor scale rule), in w's dtype."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    flat = w.reshape(-1, w.shape[-1])
    mx = torchao_mx.MXTensor.to_mx(flat, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
    return mx.dequantize(w.dtype).reshape(w.shape)


def _layer(seed: int = 0, dropout: float = 0.0):
    """A frozen fp32 expert layer under QAT with an adapter whose merge moves weights across the MXFP4
    grid (|s B A| about the grid's step), and (x, dy)."""
    g = torch.Generator().manual_seed(seed)
    base = ExpertLinear(E, 0, OUT, IN)
    with torch.no_grad():
        base.weight.copy_(torch.randn(E, OUT, IN, generator=g) * 0.02)
        base.bias.copy_(torch.randn(E, OUT, generator=g) * 0.01)
    base.requires_grad_(False)
    base.gemm = Mxfp4QatGemm()
    adapter = ExpertLoraAdapter(base, LoraSettings(rank=RANK, alpha=ALPHA, dropout=dropout))
    with torch.no_grad():
        adapter.linear_in.weight.copy_(torch.randn(E, RANK, IN, generator=g) * 0.1)
        adapter.linear_out.weight.copy_(torch.randn(E, OUT, RANK, generator=g) * 0.005)
    x = torch.randn(N, IN, generator=g)
    dy = torch.randn(N, OUT, generator=g)
    return base, adapter, x, dy


def _ours(base, adapter, x, dy, queue=None):
    """(y, dx, dA, dB) of the adapted layer."""
    adapter.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    y = adapter.adapted(base, xi, COUNTS, queue)
    y.backward(dy)
    if queue is not None:
        queue.execute()
        queue.finish_step()
    return y.detach(), xi.grad, adapter.linear_in.weight.grad, adapter.linear_out.weight.grad


def _reference(base, adapter, x, dy, mask=None):
    """float64 autograd of the rounded merged layer (STE: Q's gradient is the identity); with `mask`
    (dropout's kept-and-scaled mask) the low-rank path's dropout perturbation s B A (mask*x - x) too."""
    s = adapter.scaling
    w, b = base.weight.double(), base.bias.double()
    a = adapter.linear_in.weight.detach().double().requires_grad_()
    bb = adapter.linear_out.weight.detach().double().requires_grad_()
    xr = x.double().requires_grad_()
    m = w + s * torch.bmm(bb, a)
    mq = m + (torchao_round(m.float()).double() - m).detach()
    outs = []
    for e, xe in enumerate(torch.split(xr, COUNTS.tolist())):
        ye = xe @ mq[e].t() + b[e]
        if mask is not None:
            me = torch.split(mask.double(), COUNTS.tolist())[e]
            ye = ye + s * ((me * xe - xe) @ a[e].t()) @ bb[e].t()
        outs.append(ye)
    y = torch.cat(outs)
    y.backward(dy.double())
    return y.detach(), xr.grad, a.grad, bb.grad


def _close(got: torch.Tensor, want: torch.Tensor, n_terms: int, depth: int = 1, what: str = ""):
    """fp32 against the float64 reference: one n-term fp32 sum per GEMM on the way (tests/tolerances.py)."""
    err = (got.double() - want).abs().max().item()
    bound = reassociation_rel(n_terms, depth) * want.abs().max().item()
    assert err <= bound, f"{what}: max |diff| {err:.3g} > {bound:.3g}"


def test_forward_rounds_the_merged_weight_and_gradients_are_the_straight_through_ones():
    base, adapter, x, dy = _layer()
    y, dx, da, db = _ours(base, adapter, x, dy)
    y_ref, dx_ref, da_ref, db_ref = _reference(base, adapter, x, dy)
    _close(y, y_ref, IN, what="y")
    _close(dx, dx_ref, OUT, what="dx")  # dy @ Q(M): no unrounded s dy B A term
    _close(da, da_ref, max(N, OUT), depth=2, what="dA")  # s B^T dy^T x
    _close(db, db_ref, max(N, IN), depth=2, what="dB")  # s dy^T (x A^T)

    # the merged rounding matters here: Q(W) + s B A (rounding the base only) is far off
    old = grouped_linear(x, rounded_weight(base.weight), base.bias, COUNTS) + adapter(x, COUNTS)
    assert (old - y_ref.float()).abs().max() > 100 * reassociation_rel(IN) * y_ref.abs().max()


def test_the_forward_uses_exactly_the_weights_the_export_rounds():
    """The gemm sees Q(merged_weight(W, A, B, s)) bit for bit: the function the merged export computes."""
    base, adapter, x, _ = _layer(1)
    seen = []

    class Spy(Mxfp4QatGemm):
        def fprop(self, x, weight, tokens_per_expert):
            seen.append(rounded_weight(weight, self.merge))
            return super().fprop(x, weight, tokens_per_expert)

        def merged_with(self, merge):
            return Spy(self.inner, merge)

    base.gemm = Spy()
    with torch.no_grad():
        adapter.adapted(base, x, COUNTS)
    a, b = adapter.linear_in.weight, adapter.linear_out.weight
    want = torch.stack([torchao_round(merged_weight(base.weight[e], a[e], b[e], adapter.scaling)) for e in range(E)])
    assert torch.equal(seen[0], want)
    assert not torch.equal(want, rounded_weight(base.weight))


def test_no_grad_forward_equals_the_training_forward_and_the_merged_rounded_layer():
    base, adapter, x, dy = _layer(2)
    y, *_ = _ours(base, adapter, x, dy)
    with torch.no_grad():
        evaluated = adapter.adapted(base, x, COUNTS)
        merged = torch.stack([merged_weight(base.weight[e], adapter.linear_in.weight[e], adapter.linear_out.weight[e],
                                            adapter.scaling) for e in range(E)])
        plain = grouped_linear(x, torchao_round(merged), base.bias, COUNTS)  # a plain layer holding the export
    assert torch.equal(evaluated, y)  # the low-rank path adds exactly zero to the value
    assert torch.equal(y, plain)


def test_delayed_wgrad_queues_the_adapters_gradients_only():
    base, adapter, x, dy = _layer(3)
    y, dx, da, db = _ours(base, adapter, x, dy)
    queue = WgradQueue()
    adapter.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    adapter.adapted(base, xi, COUNTS, queue).backward(dy)
    assert adapter.linear_in.weight.grad is None and len(queue) == 2  # A and B; the frozen base queues none
    queue.execute()
    queue.finish_step()
    assert torch.equal(xi.grad, dx)
    assert torch.equal(adapter.linear_in.weight.grad, da) and torch.equal(adapter.linear_out.weight.grad, db)


def test_dropout_perturbs_the_rounded_merged_layer_by_the_low_rank_paths_dropout():
    """With dropout p the forward is Q(M) x + s B A (dropout(x) - x): the adapters' gradients are the
    ordinary dropout-LoRA ones (their input dropout(x)), and at p's expectation the layer is the export's."""
    p = 0.25
    base, adapter, x, dy = _layer(4, dropout=p)
    torch.manual_seed(7)
    y, dx, da, db = _ours(base, adapter, x, dy)
    torch.manual_seed(7)
    mask = F.dropout(torch.ones_like(x), p)  # the same draw: 0 or 1/(1-p)
    assert (mask == 0).any()
    y_ref, dx_ref, da_ref, db_ref = _reference(base, adapter, x, dy, mask)
    _close(y, y_ref, IN + RANK, depth=2, what="y")
    _close(dx, dx_ref, OUT + IN, depth=2, what="dx")
    _close(da, da_ref, max(N, OUT), depth=2, what="dA")
    _close(db, db_ref, max(N, IN), depth=2, what="dB")
    adapter.eval()  # dropout off: the training forward is the export's layer again, exactly
    y_eval, *_ = _ours(base, adapter, x, dy)
    with torch.no_grad():
        assert torch.equal(y_eval, adapter.adapted(base, x, COUNTS))


def _mxfp4_stored(seed: int):
    """`_layer(seed)` with the base's experts stored as MXFP4 blocks/scales (lora.base_experts=mxfp4), and
    the plain layer changed to hold their decoded values W_dec as its parameter: (packed, plain, adapter, x, dy)."""
    plain, adapter, x, dy = _layer(seed)
    packed = Mxfp4ExpertLinear(E, 0, OUT, IN, dtype=torch.float32)
    with torch.no_grad():
        for e in range(E):
            Mxfp4WeightSlot(packed, e).copy_(plain.weight[e])  # encoded as the loader stores a bf16 base
        packed.bias.copy_(plain.bias)
        plain.weight.copy_(packed.decoded_weight())
    packed.gemm = Mxfp4QatGemm()
    return packed, plain, adapter, x, dy


def test_an_mxfp4_stored_base_rounds_its_decoded_weight_merged_with_the_adapters():
    """lora.base_experts=mxfp4 with QAT: the merge reads the decoded blocks/scales (the layer has no
    `.weight`) and the layer computes with Q(W_dec + s B A) and the straight-through gradients: against
    the float64 reference on W_dec, and bit for bit what a base holding W_dec as a parameter gives, also
    with delayed wgrad. Adding the adapters' path unrounded to the decoded base (the forward of an
    MXFP4-stored base without QAT, which QAT's rounding of W_dec alone would leave) is far off."""
    packed, plain, adapter, x, dy = _mxfp4_stored(5)
    with pytest.raises(AttributeError):
        packed.weight
    y, dx, da, db = got = _ours(packed, adapter, x, dy)
    y_ref, dx_ref, da_ref, db_ref = _reference(plain, adapter, x, dy)
    _close(y, y_ref, IN, what="y")
    _close(dx, dx_ref, OUT, what="dx")
    _close(da, da_ref, max(N, OUT), depth=2, what="dA")
    _close(db, db_ref, max(N, IN), depth=2, what="dB")
    plain.gemm = Mxfp4QatGemm()
    for what, other in (("a parameter base", _ours(plain, adapter, x, dy)),
                        ("delayed wgrad", _ours(packed, adapter, x, dy, WgradQueue()))):
        for name, g, o in zip(("y", "dx", "dA", "dB"), got, other):
            assert torch.equal(g, o), f"{what}: {name}"
    with torch.no_grad():
        unrounded = packed(x, COUNTS) + adapter(x, COUNTS)
    assert (unrounded - y_ref.float()).abs().max() > 100 * reassociation_rel(IN) * y_ref.abs().max()
