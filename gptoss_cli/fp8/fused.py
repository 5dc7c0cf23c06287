"""FP8 quantisation as single-pass kernels: the math of fp8/scaling.py handed to torch.compile, used only where it equals the eager ops bit for bit.

Eagerly, quantising one operand is about six passes over it in fp32 (upcast, abs, amax, divide,
clamp, cast), each a kernel of its own; Inductor fuses them into one reduction and one
elementwise kernel (one C++ loop on the CPU, Triton on a GPU). The functions compiled are the
very functions the eager path calls (`scaling.tensor_math`, `row_math`, `mx_math`, and the
grouped path's in fp8/grouped_kernel.py), compiled once each with dynamic shapes (token
counts change every step).

`kernel(fn, device)` returns the compiled `fn` on a GPU where `fused_available(device)` holds, else
`fn` itself. The CPU keeps the eager ops: there FP8 is an emulation for checking numerics, and
compiling every quantiser would cost a CPU run about a minute before its first step.

The verdict is taken per device type, in the calling thread: every registered function runs
compiled and eager on probe operands that hold what the rules treat specially (zeros, negative
zeros, values that round to ties, subnormal results, values past the format's max, a block clamped
to 2^-127, powers of two on the MX boundary) and the fp8 bytes, scales and amaxes must be equal bit
for bit; a compile failure or any difference gives one warning line and the eager ops from then on.
The modules that define the functions register them when imported (scaling.py, grouped_kernel.py;
they import this module, never the other way round), so a function registered after a verdict (its
module imported later) is probed at the next `kernel` call: nothing runs compiled before its probe.
`TORCH_COMPILE_DISABLE=1` (the test suite sets it) chooses eager without a warning.
tests/fp8/test_fused_quantize.py lifts it and checks the same equality on random and edge-case operands.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Callable

import torch

_compiled: dict[Callable, Callable] = {}
_verdicts: dict[str, bool] = {}  # device type -> the verdict over the first _probed[type] registered functions
_probed: dict[str, int] = {}
_lock = threading.Lock()
# Functions the probe checks: (fn, probe-argument builder); fp8/scaling.py's and the grouped path's.
_PROBES: list[tuple[Callable, Callable[[torch.device], list[tuple]]]] = []


def register(fn: Callable, probe_args: Callable[[torch.device], list[tuple]]) -> Callable:
    """Register a quantisation function and the argument tuples the probe runs it on."""
    _PROBES.append((fn, probe_args))
    return fn


def compiled(fn: Callable) -> Callable:
    """`torch.compile(fn, dynamic=True)`, created once per function (compiling itself is lazy)."""
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]


FUSED_DEVICE_TYPES = ("cuda",)


def kernel(fn: Callable, device: torch.device) -> Callable:
    """The compiled `fn` on a GPU where the fused kernels are verified, else `fn`."""
    return compiled(fn) if device.type in FUSED_DEVICE_TYPES and fused_available(device) else fn


def fused_available(device: torch.device) -> bool:
    """Whether compiled quantisation runs here and equals the eager math bit for bit for every function
    registered so far (each probed once per device type; a failure warns once and answers False for good)."""
    kind = device.type
    verdict = _verdicts.get(kind)
    if verdict is False or (verdict and _probed.get(kind) == len(_PROBES)):
        return verdict
    with _lock:
        probes = list(_PROBES)
        done = _probed.get(kind, 0) if kind in _verdicts else None
        if done is None or (_verdicts[kind] and done < len(probes)):
            _verdicts[kind] = _probe(device, probes[done or 0:])
            _probed[kind] = len(probes)
        return _verdicts[kind]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as integers, so equality is bitwise (NaN payloads and signed zeros included)."""
    t = t.detach().contiguous()
    if t.dtype.itemsize == 1:
        return t.view(torch.uint8)
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    return all(_same(x, y) for x, y in zip(a, b)) and len(a) == len(b)


def _probe(device: torch.device, probes: list[tuple[Callable, Callable[[torch.device], list[tuple]]]]) -> bool:
    if os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1":
        return False
    try:
        for fn, probe_args in probes:
            for args in probe_args(device):
                if not _same(compiled(fn)(*args), fn(*args)):
                    warnings.warn(f"compiled FP8 quantisation ({fn.__name__}) differs from the eager ops on "
                                  f"{device.type}; quantising with the eager ops", stacklevel=4)
                    return False
    except Exception as exc:  # noqa: BLE001 - any compiler failure means: use eager
        reason = (str(exc).strip().splitlines() or [""])[0][:160]
        warnings.warn(f"compiled FP8 quantisation unavailable on {device.type} ({type(exc).__name__}: {reason}); "
                      "quantising with the eager ops", stacklevel=4)
        return False
    return True


def edge_values(device: torch.device, rows: int = 6, cols: int = 64, seed: int = 0) -> torch.Tensor:
    """fp32 [rows, cols] of random magnitudes over 2^-140..2^140 with the special values mixed in
    (zeros of both signs, exact powers of two, 448 and 57344 neighbours, ties of e4m3 and e5m2
    after scaling, a whole block of tiny values); rows >= 2 (dynamic shapes specialise 0 and 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-20, 21, (rows, 1), generator=g).float())
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 480.0, 57344.0, 61440.0, 1.0625, 1.1875,
                            2.0**-9, 3 * 2.0**-10, 2.0**-10, -(2.0**-11), 2.0**-126, 2.0**-149, 512.0, 1.5e38])
    x[0, :special.numel()] = special
    x[1, :32] = 2.0**-140  # a block below e4m3's range at any scale: its exponent clamps to -127
    return x.to(device)


__all__ = ["register", "compiled", "kernel", "fused_available", "edge_values", "FUSED_DEVICE_TYPES"]
