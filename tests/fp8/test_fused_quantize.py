"""Compiled FP8 quantisation (fp8/fused.py) equals the eager ops bit for bit, and anything else falls back to eager.

Compiling costs seconds on a shared CPU: the compiled checks are few (the MX quantiser, the most
intricate: frexp, exponent bits, a clamped block; and the grouped path's per-expert one along the
tokens, a scatter-max; on random and edge-case operands of several shapes: dynamic shapes, so one
graph each). The tensorwise and rowwise quantisers are checked where the probe runs them, at the
first FP8 GEMM of a run. The probe's own logic is tested without compiling.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from gptoss_cli.fp8 import fused, grouped_kernel, scaling
from gptoss_cli.fp8.scaling import E4M3, E5M2


@pytest.fixture
def compiling(monkeypatch):
    """torch.compile allowed for this test (the suite sets TORCH_COMPILE_DISABLE=1); verdicts forgotten."""
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    monkeypatch.setattr(fused, "_verdicts", {})


def _shapes(device):
    for seed, (rows, cols) in enumerate([(7, 96), (33, 64), (2, 32)]):
        yield fused.edge_values(device, rows, cols, seed=seed)


def test_compiled_mx_quantiser_equals_eager_bit_for_bit(compiling):
    for x in _shapes(torch.device("cpu")):
        x = x.to(torch.bfloat16)
        got = fused.compiled(scaling.mx_math)(x, E5M2.max, E5M2.dtype)
        assert fused._same(got, scaling.mx_math(x, E5M2.max, E5M2.dtype))


def test_compiled_per_expert_token_quantiser_equals_eager_bit_for_bit(compiling):
    for x in _shapes(torch.device("cpu")):
        experts = torch.sort(torch.randint(0, 4, (x.shape[0],), generator=torch.Generator().manual_seed(3))).values
        args = (x, experts, 4, E4M3.max, E4M3.dtype, False)
        assert fused._same(fused.compiled(grouped_kernel.tokens_math)(*args), grouped_kernel.tokens_math(*args))


def test_a_compiled_quantiser_that_differs_is_never_used(compiling, monkeypatch):
    def off_by_one_ulp(fn):
        def wrong(*args):
            out = fn(*args)
            return (out[0], torch.nextafter(out[1], torch.full_like(out[1], torch.inf)), *out[2:])
        return wrong

    monkeypatch.setattr(fused, "compiled", off_by_one_ulp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fused.fused_available(torch.device("cpu")) is False
        assert fused.fused_available(torch.device("cpu")) is False  # decided once: one warning
    lines = [str(w.message) for w in caught]
    assert len(lines) == 1 and "differs from the eager ops on cpu" in lines[0], lines
    assert fused.kernel(scaling.row_math, torch.device("cpu")) is scaling.row_math


def test_a_compiler_failure_is_one_warning_and_eager(compiling, monkeypatch):
    def broken(fn):
        def fail(*args):
            raise RuntimeError("no C++ compiler\nsecond line")
        return fail

    monkeypatch.setattr(fused, "compiled", broken)
    with pytest.warns(UserWarning, match=r"^compiled FP8 quantisation unavailable on cpu \(RuntimeError: no C\+\+ compiler\)"):
        assert fused.fused_available(torch.device("cpu")) is False


def test_without_compilation_the_eager_ops_run_without_a_warning(monkeypatch):
    monkeypatch.setattr(fused, "_verdicts", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fused.fused_available(torch.device("cpu")) is False  # TORCH_COMPILE_DISABLE=1 in the suite


def test_a_function_registered_after_the_verdict_is_probed_before_it_runs_compiled(compiling, monkeypatch):
    # The registering modules import fused.py, never the other way round: one imported after the verdict
    # registers late, and its functions must still be probed before `kernel` hands out their compiled form.
    wrong = set()

    def stand_in(fn):  # "compiling" that equals the eager ops except for the functions in `wrong`
        return (lambda *args: tuple(t + 1 for t in fn(*args))) if fn in wrong else (lambda *args: fn(*args))

    monkeypatch.setattr(fused, "_PROBES", list(fused._PROBES))
    monkeypatch.setattr(fused, "compiled", stand_in)
    monkeypatch.setattr(fused, "FUSED_DEVICE_TYPES", ("cpu",))
    cpu = torch.device("cpu")
    assert fused.fused_available(cpu) is True  # scaling.py's and grouped_kernel.py's functions
    assert fused.kernel(scaling.row_math, cpu) is not scaling.row_math  # the stand-in's "compiled" form

    def late(x):
        return (x * 2,)

    wrong.add(late)
    fused.register(late, lambda device: [(torch.ones(2, device=device),)])
    with pytest.warns(UserWarning, match=r"compiled FP8 quantisation \(late\) differs from the eager ops on cpu"):
        compiled_late = fused.kernel(late, cpu)
    assert compiled_late is late and fused.fused_available(cpu) is False
