"""The compiled clamped SwiGLU (model/swiglu_kernel.py) against the eager autograd Function (model/mlp.py).

The suite runs with TORCH_COMPILE_DISABLE=1 (tests/conftest.py); the `compiling` fixture lifts it
for one test. Compiling costs seconds on a shared CPU, so the compiled tests are few and share the
two compiled graphs (one per dtype) within a process.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import gptoss_cli.model.swiglu_kernel as kernel_module
from gptoss_cli.model.mlp import DenseMLPLayer, clamped_swiglu
from gptoss_cli.model.moe import GroupedExperts
from tests.model.conftest import TINY
from tests.tolerances import U_BF16, swiglu_error_bounds

LIMIT, ALPHA = 7.0, 1.702


@pytest.fixture
def compiling(monkeypatch):
    """torch.compile allowed for this test; the cached verdicts forgotten before and after."""
    import torch._dynamo

    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    monkeypatch.setattr(kernel_module, "_verdicts", {})
    with torch._dynamo.config.patch(disable=False):  # read from the environment when dynamo was imported
        yield


def _inputs(rows: int, i: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    """fc1 outputs [rows, 2I] with every clamp edge on each half: exactly -limit and +limit (gradient
    passes), just beyond (none), far beyond, a gate deep in the negative tail (sigmoid subnormal) and
    0 / -1 (products exactly zero); the rest normal with std 4."""
    g = torch.Generator().manual_seed(seed)
    gate_up = 4 * torch.randn(rows, 2 * i, generator=g)
    edges = torch.tensor([-LIMIT, LIMIT, LIMIT * (1 + 2**-20), -LIMIT * (1 + 2**-20), 9.0, -9.0, -60.0, 0.0, -1.0])
    n = min(len(edges), i)
    gate_up[0, :n] = edges[:n]  # gate
    gate_up[1, i:i + n] = edges[:n]  # up
    if rows > 2:  # both
        gate_up[2, :n] = edges[:n]
        gate_up[2, i:i + n] = edges[:n].flip(0)
    return gate_up.to(dtype), torch.randn(rows, i, generator=g).to(dtype)


def _eager(gate_up: torch.Tensor, dy: torch.Tensor):
    x = gate_up.detach().requires_grad_()
    out = clamped_swiglu(x, LIMIT, ALPHA, "eager")
    (grad,) = torch.autograd.grad(out, x, dy)
    return out.detach(), grad


def _compiled(gate_up: torch.Tensor, dy: torch.Tensor):
    x = gate_up.detach().requires_grad_()
    out = clamped_swiglu(x, LIMIT, ALPHA, "auto")
    (grad,) = torch.autograd.grad(out, x, dy)
    return out.detach(), grad


def _assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str):
    err = (got.double() - want.double()).abs()
    worst = (err - bound).argmax()
    within = bool((err <= bound).all())
    assert within, (f"{what}: |diff| {err.flatten()[worst].item():.3g} > bound "
                                  f"{bound.flatten()[worst].item():.3g} at flat index {worst.item()}")


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_compiled_fp32_forward_and_backward_equal_eager_within_the_error_model(compiling):
    # 37 rows x I = 40: tails of every vector width; clamp edges on both halves (see _inputs)
    gate_up, dy = _inputs(37, 40)
    out, grad = _compiled(gate_up, dy)
    want_out, want_grad = _eager(gate_up, dy)
    assert kernel_module._verdicts[("cpu", torch.float32)] is True  # it ran compiled, not a fallback
    b_out, b_grad = swiglu_error_bounds(gate_up, dy, LIMIT, ALPHA)
    _assert_within(out, want_out, b_out, "forward")
    _assert_within(grad, want_grad, b_grad, "backward")
    # The clamps' convention, exactly: no gradient beyond the bounds, gradient at them.
    assert (grad[0, [2, 4]] == 0).all() and (grad[0, [0, 1]] != 0).all()  # gate > limit: none
    assert (grad[1, 40 + 2: 40 + 6] == 0).all() and (grad[1, 40:40 + 2] != 0).all()  # |up| > limit: none
    # One compiled graph each for forward and backward serves every row count and shape after it.
    graphs = _unique_graphs()
    for rows in (2, 3, 500):
        _compiled(*_inputs(rows, 40, seed=rows))
    clamped_swiglu(torch.randn(2, 3, 80), LIMIT, ALPHA, "auto")  # a `-` layer's [B, S, 2I]
    with torch.no_grad():  # recompute and inference: the forward graph, under no_grad as inside the Function
        clamped_swiglu(torch.randn(9, 80, requires_grad=True), LIMIT, ALPHA, "auto")
    assert _unique_graphs() == graphs


def test_compiled_bf16_is_the_fp32_result_rounded_once(compiling):
    # The compiled kernel computes bf16 in fp32 and rounds once; the reference is the eager Function
    # in fp32 on the same (bf16-valued) inputs, so the bound is one bf16 roundoff plus the fp32 model.
    gate_up, dy = _inputs(37, 40, torch.bfloat16)
    out, grad = _compiled(gate_up, dy)
    assert kernel_module._verdicts[("cpu", torch.bfloat16)] is True
    assert out.dtype == grad.dtype == torch.bfloat16
    want_out, want_grad = _eager(gate_up.float(), dy.float())
    b_out, b_grad = swiglu_error_bounds(gate_up, dy, LIMIT, ALPHA)
    _assert_within(out, want_out, U_BF16 * (want_out.double().abs() + b_out) + b_out, "forward")
    _assert_within(grad, want_grad, U_BF16 * (want_grad.double().abs() + b_grad) + b_grad, "backward")


def test_a_recomputed_activation_equals_the_kept_one_with_the_compiled_kernel(compiling):
    # moe_act recompute (model/recompute.py, discard_saved) rebuilds fc2's input with the same kernel
    # in backward, under no_grad: the gradients are bitwise those of keeping it; an expert gets no tokens.
    experts = GroupedExperts(TINY, 4, 0)
    g = torch.Generator().manual_seed(1)
    for p in experts.parameters():
        p.data.normal_(0, 0.5, generator=g)
    experts.swiglu_kernel = "auto"
    x = torch.randn(24, TINY.hidden_size, generator=g)
    counts = torch.tensor([10, 0, 9, 5])
    dy = torch.randn(24, TINY.hidden_size, generator=g)

    def grads(recompute_act: bool):
        experts.recompute_act = recompute_act
        xg = x.clone().requires_grad_()
        out = experts(xg, counts)
        return torch.autograd.grad(out, [xg, *experts.parameters()], dy)

    kept = grads(False)
    assert kernel_module._verdicts[("cpu", torch.float32)] is True
    for a, b in zip(grads(True), kept):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_zero_and_one_rows_take_the_eager_form_without_compiling(monkeypatch):
    # An expert group with no tokens (or one) must not compile a specialised graph: eager, same results.
    def no_compile(*_a):
        raise AssertionError("compiled for a 0- or 1-row input")

    monkeypatch.setattr(kernel_module, "compiled_swiglu_available", no_compile)
    import gptoss_cli.model.mlp as mlp
    monkeypatch.setattr(mlp, "compiled_swiglu_available", no_compile)
    for rows in (0, 1):
        x = torch.randn(rows, 16, requires_grad=True)
        out = clamped_swiglu(x, LIMIT, ALPHA, "auto")
        assert out.shape == (rows, 8)
        (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
        torch.testing.assert_close(grad, _eager(x, torch.ones(rows, 8))[1], rtol=0, atol=0)


def test_without_a_cxx_compiler_the_eager_form_runs_after_one_warning(compiling):
    # A host without a working C++ compiler: Inductor is pointed at one that does not exist, with its
    # caches off and dynamo's compiled code forgotten, so the first call really compiles (and fails).
    import torch._inductor.config as inductor_config

    torch.compiler.reset()
    gate_up, dy = _inputs(8, 16)
    try:
        with inductor_config.patch({"cpp.cxx": ("/nonexistent/g++",), "fx_graph_cache": False}), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = _compiled(gate_up, dy)
            second = _compiled(gate_up, dy)  # the verdict is cached: no second try, no second warning
    finally:
        torch.compiler.reset()  # no half-built state for the next test
    lines = [str(w.message) for w in caught if "SwiGLU" in str(w.message)]
    assert len(lines) == 1 and lines[0].startswith("compiled SwiGLU unavailable on cpu torch.float32 ("), lines
    assert "C++ compiler" in lines[0] and "\n" not in lines[0], lines[0]
    assert kernel_module._verdicts == {("cpu", torch.float32): False}
    want = _eager(gate_up, dy)
    for got in (first, second):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_kernel_that_disagrees_with_eager_is_not_used(compiling, monkeypatch):
    # The probe compares with the eager Function: a wrong kernel (here: the up clamp lost) falls back.
    def wrong_forward(gate_up, limit, alpha):
        gate, up = gate_up.chunk(2, dim=-1)
        g = gate.clamp(max=limit)
        return (up + 1) * g * torch.sigmoid(alpha * g)

    monkeypatch.setattr(kernel_module, "_kernels", lambda: (wrong_forward, kernel_module.swiglu_backward))
    with pytest.warns(UserWarning, match="forward disagrees with the eager kernel"):
        gate_up, dy = _inputs(8, 16)
        torch.testing.assert_close(_compiled(gate_up, dy), _eager(gate_up, dy), rtol=0, atol=0)
    assert kernel_module._verdicts[("cpu", torch.float32)] is False


def test_torch_compile_disable_chooses_eager_without_a_warning(monkeypatch):
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    monkeypatch.setattr(kernel_module, "_verdicts", {})
    monkeypatch.setattr(kernel_module, "_kernels", lambda: pytest.fail("compiled with TORCH_COMPILE_DISABLE=1"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gate_up, dy = _inputs(8, 16)
        torch.testing.assert_close(_compiled(gate_up, dy), _eager(gate_up, dy), rtol=0, atol=0)


def test_the_layers_take_the_kernel_the_model_is_given():
    from gptoss_cli.errors import ConfigError
    from gptoss_cli.model.hybrid import HybridModel
    from gptoss_cli.model.pattern import parse_pattern

    model = HybridModel(TINY, parse_pattern("*E*-*E"))
    layers = [m for m in model.modules() if isinstance(m, (GroupedExperts, DenseMLPLayer))]
    assert {m.swiglu_kernel for m in layers} == {"eager"}  # built directly: eager, as tests expect
    model.set_swiglu_kernel("auto")
    assert {m.swiglu_kernel for m in layers} == {"auto"} and len(layers) == 3
    with pytest.raises(ConfigError, match="model.swiglu_kernel 'fast' is not one of auto, eager"):
        model.set_swiglu_kernel("fast")


@pytest.mark.parametrize("kernel", ["auto", "eager"])
def test_the_recipe_setting_reaches_every_activation(kernel):
    # recipe model.swiglu_kernel -> ModelRuntimeConfig -> the provider's model (what `gptoss train` builds)
    from gptoss_cli.model.pattern import parse_pattern
    from gptoss_cli.parallel.state import ParallelState
    from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig
    from tests.train.jobs import recipe_config

    recipe = recipe_config()
    assert recipe.model.swiglu_kernel == "auto"  # the recipe's default
    recipe.model.swiglu_kernel = kernel
    cfg = ModelRuntimeConfig.from_recipe(recipe, TINY, parse_pattern("*E*-*E"))
    model = HybridModelProvider(cfg, seed=0).provide(ParallelState())
    layers = [m for m in model.modules() if isinstance(m, (GroupedExperts, DenseMLPLayer))]
    assert len(layers) == 3 and {m.swiglu_kernel for m in layers} == {kernel}


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_a_first_call_without_autograd_still_gets_the_compiled_kernels(compiling, context):
    """A GRPO run's first MoE forward is its rollout's, under no_grad: the probe's eager reference needs
    autograd, and without it the whole run fell back to the eager kernel with a warning."""
    gate_up, dy = _inputs(8, 16)
    outer = torch.no_grad() if context == "no_grad" else torch.inference_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with outer:
            out = clamped_swiglu(gate_up, LIMIT, ALPHA, "auto")
    assert kernel_module._verdicts[("cpu", torch.float32)] is True
    assert torch.equal(out, _compiled(gate_up, dy)[0])  # the same compiled kernel as with autograd
