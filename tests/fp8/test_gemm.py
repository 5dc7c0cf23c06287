"""Each FP8 recipe's forward, input-gradient and weight-gradient GEMMs against fp64, within the bounds
of tests/fp8/bounds.py (worst case per element, and the typical relative error).

The GEMMs run through the model's seam (`model.dense_gemm.linear` with the recipe's gemm), so the
autograd function, the operand roles and the re-quantisation of transposed operands are what is
tested. Each GEMM gets operands whose magnitudes span 2^32 along the axes it does NOT contract
(rows of x for fprop, columns of W for dgrad, columns of x and dy for wgrad): quantising along
the wrong axis would put values 2^32 apart in one scale group and flush the small ones to zero,
far outside the bound computed with the right groups.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from gptoss_cli.errors import TrainingError
from gptoss_cli.fp8.catalog import RECIPES as FP8_RECIPES
from gptoss_cli.fp8.grouped import Fp8GroupedGemm
from gptoss_cli.fp8.linear import Fp8LinearGemm
from gptoss_cli.fp8.matmul import BLOCK_SCALED_MM, DEQUANTIZE, SCALED_MM, Fp8Numerics
from gptoss_cli.fp8.selection import Fp8Settings, select_gemms
from gptoss_cli.fp8.scaling import E4M3, E5M2
from gptoss_cli.model.gemm.dense import linear
from gptoss_cli.model.gemm.grouped import WgradQueue, grouped_linear
from tests.fp8.bounds import check_gemm
from tests.tolerances import assert_tensors_close, reassociation_rel

RECIPES = ["tensorwise", "rowwise", "mxfp8"]
# (tokens M, in, out): odd token counts; 160 and 2880 are multiples of 32 but not of 128 (GPT-OSS's
# hidden size is 2880); 72 is not even a multiple of 32 (MX pads the last block with zeros).
SHAPES = [(37, 160, 96), (45, 2880, 64), (19, 72, 40)]


def _spread(n: int, g: torch.Generator) -> torch.Tensor:
    """n powers of two between 2^-16 and 2^16."""
    return torch.exp2(torch.randint(-16, 17, (n,), generator=g).double()).float()


def _operands(gemm: str, m: int, k_in: int, n_out: int, seed: int, spread: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k_in, generator=g)
    w = torch.randn(n_out, k_in, generator=g) / k_in**0.5
    dy = torch.randn(m, n_out, generator=g)
    if not spread:
        return x, w, dy
    if gemm == "fprop":
        x, w = x * _spread(m, g)[:, None], w * _spread(n_out, g)[:, None]
    elif gemm == "dgrad":
        dy, w = dy * _spread(m, g)[:, None], w * _spread(k_in, g)[None, :]
    else:
        dy, x = dy * _spread(n_out, g)[None, :], x * _spread(k_in, g)[None, :]
    return x, w, dy


def _gemm(recipe: str, fmt: str) -> Fp8LinearGemm:
    return select_gemms(Fp8Settings(recipe, fmt, emulation=True), "cpu").dense("layers.0.linear_qkv")


def _run_layer(recipe: str, fmt: str, gemm: str, shape: tuple[int, int, int], spread: bool) -> None:
    """Forward and backward of one linear layer; check the GEMM `gemm` against its bounds."""
    m, k_in, n_out = shape
    x, w, dy = _operands(gemm, m, k_in, n_out, zlib.crc32(f"{recipe}{fmt}{gemm}{shape}".encode()), spread)
    bias = torch.randn(n_out)
    x.requires_grad_(True)
    w.requires_grad_(True)
    b = bias.clone().requires_grad_(True)
    y = linear(x, w, b, gemm=_gemm(recipe, fmt))
    y.backward(dy)
    scaling, grad_fmt = FP8_RECIPES[recipe].scaling, "e5m2" if fmt == "hybrid" else "e4m3"
    kw = dict(scaling=scaling, worst_case=spread, typical=not spread)
    if gemm == "fprop":  # y = x W^T + b, contraction over in
        check_gemm(y.detach(), x.detach(), w.detach(), "e4m3", "e4m3", what="fprop", extra=bias, **kw)
    elif gemm == "dgrad":  # dx = dy W, contraction over out
        check_gemm(x.grad, dy, w.detach().t(), grad_fmt, "e4m3", what="dgrad", **kw)
    else:  # dW = dy^T x, contraction over the tokens
        check_gemm(w.grad, dy.t(), x.detach().t(), grad_fmt, "e4m3", what="wgrad", **kw)
        # the bias gradient is an fp32 sum outside the GEMM (error <= M 2^-24 sum|dy|)
        assert torch.allclose(b.grad, dy.sum(0), rtol=0, atol=m * 2**-24 * dy.abs().sum().item())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_element_of_each_gemm_is_within_its_worst_case_bound(recipe, fmt, gemm, shape):
    _run_layer(recipe, fmt, gemm, shape, spread=True)


@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_gemm_has_the_typical_error_of_its_formats(recipe, fmt, gemm):
    # Gaussian operands of one magnitude: the relative Frobenius error averages M x N elements,
    # so it sits near the random-walk model (tests/fp8/bounds.py), neither far above nor far below.
    _run_layer(recipe, fmt, gemm, (96, 2880, 160), spread=False)


@pytest.mark.parametrize("recipe", RECIPES)
def test_bf16_activations_round_the_fp32_sum_once(recipe):
    # The training dtype: operands bf16, output rounded to bf16 (u_out = 2^-8 in the bound).
    x, w, dy = _operands("fprop", 33, 96, 64, seed=7)
    x, w = x.bfloat16(), w.bfloat16()
    y = linear(x, w, None, gemm=_gemm(recipe, "e4m3"))
    assert y.dtype == torch.bfloat16
    check_gemm(y, x, w, "e4m3", "e4m3", scaling=FP8_RECIPES[recipe].scaling, what="fprop bf16", worst_case=True, typical=False)


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_cpu_scaled_mm_kernel_equals_the_dequantize_emulation(scaling):
    # On CPU tensorwise/rowwise run torch._scaled_mm; GPUs without FP8 dequantise and matmul in fp32.
    # Same quantised operands, so they differ only by fp32 rounding: the scale applied after the sum
    # instead of to each element (2^-24 each), and summation order (K 2^-24): <= 4 K 2^-24 x |C|.
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(29, 160, generator=g), torch.randn(48, 160, generator=g)
    kw = dict(grad_operand=None, where="t", names=("a", "b"), out_dtype=torch.float32)
    via_scaled_mm = Fp8Numerics(scaling, E4M3, E5M2, SCALED_MM).matmul(a, b, **kw)
    via_dequant = Fp8Numerics(scaling, E4M3, E5M2, DEQUANTIZE).matmul(a, b, **kw)
    scale = (a.abs() @ b.abs().t())
    assert torch.all((via_scaled_mm - via_dequant).abs() <= 4 * 160 * 2**-24 * scale)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a device without block-scaled kernels")
def test_a_failing_native_kernel_is_an_error_never_a_fallback():
    # torch has no block-scaled MX kernel on CPU: the GEMM must stop with the layer's name, not
    # quietly compute something else.
    numerics = Fp8Numerics("mx", E4M3, E4M3, BLOCK_SCALED_MM)
    with pytest.raises(TrainingError, match="layers.1.mlp.experts.linear_fc2 fprop: the FP8 kernel block_scaled_mm failed"):
        numerics.matmul(torch.randn(8, 64), torch.randn(16, 64), grad_operand=None,
                        where="layers.1.mlp.experts.linear_fc2 fprop", names=("input", "weight"), out_dtype=torch.float32)


def test_nan_in_a_layer_input_is_an_error_naming_the_layer_and_gemm():
    x = torch.randn(5, 64)
    x[2, 3] = float("nan")
    with pytest.raises(TrainingError, match="layers.0.linear_qkv fprop input contains NaN"):
        linear(x, torch.randn(32, 64), None, gemm=_gemm("mxfp8", "e4m3"))


def test_inf_in_an_output_gradient_is_an_error_in_dgrad():
    x = torch.randn(5, 64, requires_grad=True)
    y = linear(x, torch.randn(32, 64), None, gemm=_gemm("rowwise", "hybrid"))
    dy = torch.ones_like(y)
    dy[0, 0] = float("inf")
    with pytest.raises(TrainingError, match="layers.0.linear_qkv dgrad output gradient contains inf"):
        y.backward(dy)


# --- grouped: per-expert GEMMs, MX padding, biases outside ------------------------------------------
def _grouped(recipe: str, fmt: str = "hybrid") -> tuple[Fp8GroupedGemm, Fp8LinearGemm]:
    gemms = select_gemms(Fp8Settings(recipe, fmt, emulation=True), "cpu")
    return gemms.grouped("layers.1.mlp.experts.linear_fc1"), gemms.dense("layers.1.mlp.experts.linear_fc1")


COUNTS = [5, 0, 37, 32]  # an empty expert, one group of whole blocks, others not multiples of 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_gemms_are_each_experts_own_fp8_gemm(recipe, fmt, dtype):
    # Tensorwise scales are per expert operand; MX blocks never straddle two experts: equal to the
    # dense FP8 gemm on each expert's rows alone, bit for bit.
    grouped, dense = _grouped(recipe, fmt)
    g = torch.Generator().manual_seed(5)
    counts = torch.tensor(COUNTS)
    n = sum(COUNTS)
    x = torch.randn(n, 64, generator=g) * torch.repeat_interleave(torch.tensor([1e-3, 1.0, 1e3, 1.0]), counts)[:, None]
    w, dy = torch.randn(4, 96, 64, generator=g), torch.randn(n, 96, generator=g)
    x, w, dy = x.to(dtype), w.to(dtype), dy.to(dtype)
    xs, dys = torch.split(x, COUNTS), torch.split(dy, COUNTS)
    assert torch.equal(grouped.fprop(x, w, counts), torch.cat([dense.fprop(xs[e], w[e]) for e in range(4)]))
    assert torch.equal(grouped.dgrad(dy, w, counts), torch.cat([dense.dgrad(dys[e], w[e]) for e in range(4)]))
    assert torch.equal(grouped.wgrad(x, dy, counts), torch.stack([dense.wgrad(xs[e], dys[e]) for e in range(4)]))


def test_mxfp8_quantises_each_experts_tokens_alone_and_pads_them_to_32_where_they_are_blocked(monkeypatch):
    import gptoss_cli.fp8.matmul as matmul

    shapes = []
    real = matmul.run_kernel

    def spy(kernel, qa, qb, out_dtype):
        shapes.append((tuple(qa.data.shape), tuple(qb.data.shape)))
        return real(kernel, qa, qb, out_dtype)

    monkeypatch.setattr(matmul, "run_kernel", spy)
    grouped, _ = _grouped("mxfp8")
    counts = torch.tensor(COUNTS)
    n = sum(COUNTS)
    x, w = torch.randn(n, 64), torch.randn(4, 96, 64)
    assert grouped.fprop(x, w, counts).shape == (n, 96)
    # fprop blocks along the features: each expert's own rows, unpadded (the empty expert runs no GEMM)
    assert [s[0][0] for s in shapes] == [5, 37, 32]
    shapes.clear()
    grouped.wgrad(x, torch.randn(n, 96), counts)
    # wgrad contracts over the tokens: each expert's group padded to whole blocks of 32
    assert [s[0][1] for s in shapes] == [32, 64, 32]


@pytest.mark.parametrize("recipe", RECIPES)
def test_non_finite_expert_operand_is_an_error_naming_the_first_such_expert_and_operand(recipe):
    grouped, _ = _grouped(recipe)
    counts = torch.tensor(COUNTS)
    n = sum(COUNTS)
    x, w, dy = torch.randn(n, 64), torch.randn(4, 96, 64), torch.randn(n, 96)
    w[1] = float("nan")  # expert 1 has no tokens: no GEMM reads its weight, so no error
    assert torch.isfinite(grouped.fprop(x, w, counts)).all()
    x[n - 1, 3] = float("nan")  # expert 3's input
    x[COUNTS[0] + 2, 7] = float("inf")  # expert 2's input comes first
    with pytest.raises(TrainingError, match=r"linear_fc1 \(local expert 2\) fprop input contains inf"):
        grouped.fprop(x, w, counts)
    w[3, 0, 0] = float("inf")
    dy[n - 1, 0] = float("nan")
    with pytest.raises(TrainingError, match=r"linear_fc1 \(local expert 3\) dgrad output gradient contains NaN"):
        grouped.dgrad(dy, w, counts)
    with pytest.raises(TrainingError, match=r"linear_fc1 \(local expert 2\) wgrad input contains inf"):
        grouped.wgrad(x, dy, counts)


def test_expert_bias_is_added_outside_the_gemm_and_never_to_padding_rows():
    # Large biases, MX padding: the layer's output is the gemm's output plus each real row's own
    # expert bias, and the bias gradient sums exactly the real rows of each expert.
    grouped, _ = _grouped("mxfp8")
    counts = torch.tensor(COUNTS)
    n = sum(COUNTS)
    x = torch.randn(n, 64, requires_grad=True)
    w = torch.randn(4, 96, 64, requires_grad=True)
    bias = (1e4 * torch.randn(4, 96)).requires_grad_(True)
    y = grouped_linear(x, w, bias, counts, gemm=grouped)
    owner = torch.repeat_interleave(torch.arange(4), counts)
    assert y.shape == (n, 96)
    assert torch.equal(y.detach(), grouped.fprop(x.detach(), w.detach(), counts) + bias.detach()[owner])
    dy = torch.randn(n, 96)
    y.backward(dy)
    # Summed in another order than this fp64 reference: within the reassociation bound of the
    # largest expert's rows (tests/tolerances.py); a missing or extra row is off by a whole |dy|.
    want = torch.zeros(4, 96, dtype=torch.float64).index_add_(0, owner, dy.double())
    assert_tensors_close({"db": bias.grad}, {"db": want}, reassociation_rel(max(COUNTS)))


def test_delayed_wgrad_runs_the_same_fp8_gemm_later():
    grouped, _ = _grouped("rowwise")
    counts = torch.tensor(COUNTS)
    n = sum(COUNTS)
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(n, 64, generator=g), torch.randn(n, 96, generator=g)
    w0, b0 = torch.randn(4, 96, 64, generator=g), torch.randn(4, 96, generator=g)
    grads = []
    for queue in (None, WgradQueue()):
        xi, w, b = x.clone().requires_grad_(True), w0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        grouped_linear(xi, w, b, counts, gemm=grouped, wgrad_queue=queue).backward(dy)
        if queue is not None:
            assert w.grad is None and len(queue) == 1
            before = grouped.stats.gemms["wgrad"]
            queue.execute()
            assert grouped.stats.gemms["wgrad"] == before + 3  # three non-empty experts, FP8 again
        grads.append((xi.grad, w.grad, b.grad))
    for now, later in zip(*grads):
        assert torch.equal(now, later)


@pytest.mark.parametrize("fmt, grad", [("e4m3", "e4m3"), ("hybrid", "e5m2")])
def test_output_gradients_use_e5m2_only_under_hybrid(monkeypatch, fmt, grad):
    import gptoss_cli.fp8.matmul as matmul

    seen = []
    real = matmul.run_kernel
    monkeypatch.setattr(matmul, "run_kernel",
                        lambda kernel, qa, qb, out: seen.append((qa.fmt.name, qb.fmt.name)) or real(kernel, qa, qb, out))
    x = torch.randn(6, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    linear(x, w, None, gemm=_gemm("mxfp8", fmt)).sum().backward()
    # fprop (input, weight), dgrad (output gradient, weight), wgrad (output gradient, input)
    assert seen == [("e4m3", "e4m3"), (grad, "e4m3"), (grad, "e4m3")]
