"""The clamped SwiGLU as two generated single-pass kernels (torch.compile), checked once per device and dtype.

The eager form (model/mlp.py, `_ClampedSwiGLU`) runs about 25 elementwise kernels over the
`[rows, I]` activation, each a pass over memory. Here the pure math of its forward and of its
backward is handed to `torch.compile` (Inductor: one vectorised C++ loop on the CPU, one Triton
kernel on a GPU), each compiled once for every row count (`dynamic=True`: token counts change every
step), and an autograd Function keeps the eager form's memory contract around them: it saves only
the fc1 output and recomputes the rest in backward, so recompute (`discard_saved`) and the overlap
schedule see the same saved tensors as before.

`compiled_swiglu_available(device, dtype)` decides once per (device type, dtype), in the calling
thread, by compiling and running both kernels on a small probe and comparing them with the eager
Function: a missing C++ compiler or Triton, an unwritable compile cache or a wrong answer gives one
warning line and the eager form from then on, never a crash. `TORCH_COMPILE_DISABLE=1` (torch's own
switch; the test suite sets it) chooses eager without a warning.

Numerics (docs/benchmarks.md, "A single-pass SwiGLU"): fp32 results differ from the eager form by a
few ulps (another sigmoid, other roundings of three-factor products); bf16 computes in fp32 inside
the kernel and rounds once, so it is closer to the exact result than the eager form, which rounds
after every op.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Callable

import torch

# The probe the verdict is taken on: rows >= 2 (dynamic shapes specialise sizes 0 and 1), I = 8.
_PROBE_ROWS, _PROBE_I = 4, 8


def _fp32_if_half(t: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 computed in fp32 inside the kernel (rounded once on the way out), others as they are."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def swiglu_forward(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """`[N, 2I]` fc1 output `[gate; up]` -> `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`,
    g = min(gate, limit). Pure math for the compiler; computes in fp32 for bf16/fp16 inputs."""
    gate, up = _fp32_if_half(gate_up).chunk(2, dim=-1)
    g = gate.clamp(max=limit)
    out = (up.clamp(min=-limit, max=limit) + 1) * (g * torch.sigmoid(g * alpha))
    return out.to(gate_up.dtype)


def swiglu_backward(gate_up: torch.Tensor, grad_out: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """The gradient of `swiglu_forward` with respect to `gate_up`, `[N, 2I]`: the clamps pass gradient
    where the input lies inside the bounds, ends included (torch.clamp's convention), and
    d/dg [g * sigmoid(a*g)] = s * (1 + a*g*(1 - s)) with s = sigmoid(a*g)."""
    gate, up = _fp32_if_half(gate_up).chunk(2, dim=-1)
    go = _fp32_if_half(grad_out)
    g = gate.clamp(max=limit)
    s = torch.sigmoid(g * alpha)
    d_up = torch.where(up.abs() > limit, 0.0, g * s * go)
    d_glu = (up.clamp(min=-limit, max=limit) + 1) * go
    d_gate = torch.where(gate > limit, 0.0, s * (1 + g * alpha * (1 - s)) * d_glu)
    return torch.cat([d_gate, d_up], dim=-1).to(gate_up.dtype)


_compiled: dict[str, Callable[..., torch.Tensor]] = {}
_verdicts: dict[tuple[str, torch.dtype], bool] = {}
_lock = threading.Lock()


def _kernels() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """The two compiled functions (created once; torch.compile itself is lazy, and importing
    torch._dynamo costs seconds, so nothing here runs before the first `auto` call)."""
    if not _compiled:
        _compiled["forward"] = torch.compile(swiglu_forward, dynamic=True)
        _compiled["backward"] = torch.compile(swiglu_backward, dynamic=True)
    return _compiled["forward"], _compiled["backward"]


class _CompiledClampedSwiGLU(torch.autograd.Function):
    """Forward and backward each one generated kernel; saves only the fc1 output (as the eager form)."""

    @staticmethod
    def forward(ctx: Any, gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        ctx.limit, ctx.alpha = limit, alpha
        return _kernels()[0](gate_up.detach(), limit, alpha)  # detached: the graph the probe compiled

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        return _kernels()[1](gate_up.detach(), grad_out.detach().contiguous(), ctx.limit, ctx.alpha), None, None


def compiled_clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """The clamped SwiGLU of `[..., 2I]` through the compiled kernels, as `[rows, 2I]` (at least 2 rows;
    callers check `compiled_swiglu_available` first)."""
    flat = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()  # one rank and stride pattern: no recompiles
    if torch.is_grad_enabled() and flat.requires_grad:
        out = _CompiledClampedSwiGLU.apply(flat, limit, alpha)
    else:
        with torch.no_grad():  # the grad mode and the detached input the kernels were compiled for
            out = _kernels()[0](flat.detach(), limit, alpha)
    return out.view(*gate_up.shape[:-1], out.shape[-1])


def compiled_swiglu_available(device: torch.device, dtype: torch.dtype,
                              eager: Callable[[torch.Tensor, float, float], torch.Tensor]) -> bool:
    """Whether the compiled kernels run here and agree with `eager` (the eager clamped SwiGLU, with
    autograd); decided on the first call for this device type and dtype, then cached. A failure warns
    once and answers False for good."""
    key = (device.type, dtype)
    verdict = _verdicts.get(key)
    if verdict is not None:
        return verdict
    with _lock:  # one probe per key, even with callers on several threads
        if key not in _verdicts:
            _verdicts[key] = _probe(device, dtype, eager)
        return _verdicts[key]


def _probe(device: torch.device, dtype: torch.dtype,
           eager: Callable[[torch.Tensor, float, float], torch.Tensor]) -> bool:
    if os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1":
        return False
    # The first call may come from inside no_grad or inference mode (a GRPO rollout's forward, a
    # generate step): the eager reference needs autograd whatever the caller's context.
    with torch.inference_mode(False), torch.enable_grad():
        return _probe_with_autograd(device, dtype, eager)


def _probe_with_autograd(device: torch.device, dtype: torch.dtype,
                         eager: Callable[[torch.Tensor, float, float], torch.Tensor]) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = (4 * torch.randn(_PROBE_ROWS, 2 * _PROBE_I, generator=gen)).to(device=device, dtype=dtype)
    grad = torch.randn(_PROBE_ROWS, _PROBE_I, generator=gen).to(device=device, dtype=dtype)
    limit, alpha = 7.0, 1.702
    try:
        forward, backward = _kernels()
        with torch.no_grad():  # as inside the autograd Function: one compiled graph for every call
            got = (forward(x, limit, alpha), backward(x, grad, limit, alpha))
        xg = x.detach().requires_grad_()
        want_out = eager(xg, limit, alpha)
        (want_grad,) = torch.autograd.grad(want_out, xg, grad)
    except Exception as exc:  # noqa: BLE001 - any compiler failure means: use eager
        reason = (str(exc).strip().splitlines() or [""])[0][:160]
        warnings.warn(f"compiled SwiGLU unavailable on {device.type} {dtype} ({type(exc).__name__}: {reason}); "
                      "using the eager kernel (model.swiglu_kernel: eager skips this check)", stacklevel=4)
        return False
    # A generous bound: the kernels agree with eager to a few ulps (tests/tolerances.py derives it);
    # a wrong kernel (a lost clamp, a swapped half) misses by whole units.
    tol = 0.05 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    for name, a, b in (("forward", got[0], want_out), ("backward", got[1], want_grad)):
        if not torch.allclose(a.float(), b.detach().float(), rtol=tol, atol=tol):
            warnings.warn(f"compiled SwiGLU {name} disagrees with the eager kernel on {device.type} {dtype}; "
                          "using the eager kernel", stacklevel=4)
            return False
    return True


__all__ = ["swiglu_forward", "swiglu_backward", "compiled_clamped_swiglu", "compiled_swiglu_available"]
