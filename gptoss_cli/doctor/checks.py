"""Quick checks of the local device against a CPU reference, for `gptoss doctor`.

Each check computes something small on the device with the code a training run uses and compares
it with a float64 computation on the CPU from the same inputs; on a CPU-only machine the device is
the CPU, so the CPU paths are checked against float64. Bounds (relative to each tensor's largest
magnitude, as tests/tolerances.py states them): two orders of fp32 sums differ by about
SAFETY x depth x terms x 2**-24; a 16-bit result is rounded at 2**-8 a few times on its way
(forward and backward: depth 3); an FP8 product of two e4m3 operands is off by at most
(2u + u^2) x sum |a||b| with u = 2**-4, plus the output's rounding. A real fault (a wrong kernel, a
lost mask, a broken collective) misses these by whole units.

Checks: `model` (the tiny model's forward and backward, packed documents), `attention <backend>` (each
backend on full, sliding-window and packed-document layers), `grouped GEMM`, `fp8 <recipe>` (the dense
and grouped FP8 GEMMs the fp8 package selects here, native or emulated), `collective <backend>` (one
all_reduce on a one-process group: gloo, and NCCL with a GPU).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.attention.backends import choose, describe, document_attention

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
SAFETY = 4.0
U_FP32, U_BF16, U_E4M3 = 2.0**-24, 2.0**-8, 2.0**-4


@dataclass
class Check:
    name: str
    status: str  # PASS / FAIL / SKIP
    detail: str
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_checks(device: str, only: tuple[str, ...] = ()) -> list[Check]:
    """Every check on `device` ("cpu" or "cuda"), or those whose name starts with one of `only`. A check
    that raises is a FAIL naming the error, never a traceback."""
    from gptoss_cli.fp8.catalog import RECIPES

    plan: list[tuple[str, Callable[[str], tuple[str, str]]]] = [("model", check_model)]
    plan += [(f"attention {b}", _bind(check_attention, b)) for b in ("flash", "flex", "sdpa")]
    plan.append(("grouped GEMM", check_grouped_gemm))
    plan += [(f"fp8 {r}", _bind(check_fp8, r)) for r in RECIPES]
    plan += [(f"collective {b}", _bind(check_collective, b)) for b in ("gloo", "nccl")]
    out = []
    for name, fn in plan:
        if only and not any(name.startswith(o) for o in only):
            continue
        start = time.perf_counter()
        try:
            status, detail = fn(device)
        except Exception as exc:  # noqa: BLE001 - a check reports its failure, doctor goes on
            status, detail = FAIL, f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
        out.append(Check(name, status, detail, time.perf_counter() - start))
    return out


def _bind(fn: Callable[[str, str], tuple[str, str]], arg: str) -> Callable[[str], tuple[str, str]]:
    return lambda device: fn(device, arg)


def worst_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """(largest max|got - want| / max|want| over the tensors, the tensor's name)."""
    worst, where = 0.0, ""
    for name, w in want.items():
        w = w.double().cpu()
        scale = float(w.abs().max()) if w.numel() else 0.0
        err = float((got[name].double().cpu() - w).abs().max()) if w.numel() else 0.0
        rel = err / scale if scale else err
        if rel >= worst:
            worst, where = rel, name
    return worst, where


def _verdict(err: float, bound: float, where: str, what: str) -> tuple[str, str]:
    status = PASS if err <= bound else FAIL
    return status, f"{what}; max rel err {err:.2g} in {where} (bound {bound:.2g})"


def _grads(fn: Callable[..., torch.Tensor], names: tuple[str, ...], inputs: list[torch.Tensor],
           grad: torch.Tensor) -> dict[str, torch.Tensor]:
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad.to(device=out.device, dtype=out.dtype))
    return dict(zip(("out", *names), (out.detach(), *grads)))


# --- the tiny model ---------------------------------------------------------------------------------
def check_model(device: str) -> tuple[str, str]:
    """The tiny model (3 blocks, sliding and full layers, 4 experts) on the device in fp32 against
    the same weights in float64 on the CPU: loss and every parameter's gradient, packed documents."""
    from gptoss_cli.model.config import preset
    from gptoss_cli.model.hybrid import HybridModel
    from gptoss_cli.model.positions import document_offsets

    arch = preset("tiny")
    torch.manual_seed(0)
    ref = HybridModel(arch, dtype=torch.float64)
    dut = HybridModel(arch, device=device, dtype=torch.float32)
    dut.load_state_dict(ref.state_dict())
    ids = torch.randint(0, arch.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    cu = document_offsets([[7, 25], [32]], 32)
    results = []
    for model in (ref, dut):
        x = ids.to(next(model.parameters()).device)
        loss = model(x, labels=x.roll(-1, 1), cu_seqlens=cu).loss
        loss.backward()
        results.append({"loss": loss.detach().reshape(1), **{n: p.grad for n, p in model.named_parameters()}})
    err, where = worst_error(results[1], results[0])
    # fp32 sums over up to the vocabulary (1003 terms) through 2 x 3 layers and the head, forward and backward
    bound = SAFETY * 8 * 1003 * U_FP32
    return _verdict(err, bound, where, f"tiny model fp32 on {device} vs float64 on cpu")


# --- attention --------------------------------------------------------------------------------------
LAYER_KINDS = (("full", None, None), ("sliding", 48, None), ("documents", 48, (0, 100, 192, 300, 384)))


def check_attention(device: str, backend: str) -> tuple[str, str]:
    """`backend` on the device (bf16 on a GPU, fp32 on the CPU) for a full layer, a sliding-window layer
    (window 48) and packed documents, against the sdpa path in float64 on the CPU: output and the
    gradients of q, k, v and the sinks (4 query heads on 2 kv heads, 2 rows of 192 tokens, head dim 64)."""
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    gen = torch.Generator().manual_seed(0)
    shapes = ((2, 4, 192, 64), (2, 2, 192, 64), (2, 2, 192, 64), (4,))
    inputs = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]
    grad = torch.randn(2, 4, 192, 64, generator=gen, dtype=torch.float64)
    names = ("dq", "dk", "dv", "dsinks")
    worst, where, done, kernels = 0.0, "", [], set()
    for kind, window, cu in LAYER_KINDS:
        probe = inputs[0].to(device=device, dtype=dtype)
        try:
            kernel = choose(backend, probe, window, documents=cu is not None)
        except ConfigError:
            continue  # this backend does not take this layer kind here (e.g. flash on CUDA: full only)
        got = _grads(lambda *t: document_attention(*t, window, cu, backend), names,
                     [t.to(device=device, dtype=dtype) for t in inputs], grad)
        want = _grads(lambda *t: document_attention(*t, window, cu, "sdpa"), names, inputs, grad)
        err, name = worst_error(got, want)
        if err >= worst:
            worst, where = err, f"{kind} {name}"
        done.append(kind)
        kernels.add(describe(kernel, device))
    if not done:
        return SKIP, f"{backend} takes no layer kind on {device}"
    # bf16: a few roundings at 2**-8 through forward and backward; fp32: sums over the head dim or the
    # 3 x 193 keys and query heads per key, depth 3 (tests/model/test_attention_backends.py)
    bound = SAFETY * 3 * 2 * U_BF16 if dtype == torch.bfloat16 else SAFETY * 3 * 3 * 193 * U_FP32
    return _verdict(worst, bound, where, f"{', '.join(done)} in {str(dtype).removeprefix('torch.')}: "
                                         f"{'; '.join(sorted(kernels))}")


# --- grouped GEMM -----------------------------------------------------------------------------------
def check_grouped_gemm(device: str) -> tuple[str, str]:
    """The experts' grouped linear (model/gemm/grouped.py) with an empty expert, forward and the
    gradients of input, weight and bias, against a per-expert float64 loop on the CPU."""
    from gptoss_cli.model.gemm.grouped import grouped_linear

    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    counts = torch.tensor([40, 0, 56, 24])
    gen = torch.Generator().manual_seed(2)
    x, w, b = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((120, 64), (4, 96, 64), (4, 96)))
    grad = torch.randn(120, 96, generator=gen, dtype=torch.float64)

    def loop(x, w, b):
        rows = torch.split(x, counts.tolist())
        return torch.cat([r @ w[e].t() + b[e] for e, r in enumerate(rows)])

    got = _grads(lambda *t: grouped_linear(*t, counts.to(device)), ("dx", "dw", "db"),
                 [t.to(device=device, dtype=dtype) for t in (x, w, b)], grad)
    want = _grads(loop, ("dx", "dw", "db"), [x, w, b], grad)
    err, where = worst_error(got, want)
    bound = SAFETY * 3 * U_BF16 if dtype == torch.bfloat16 else SAFETY * 120 * U_FP32
    return _verdict(err, bound, where, f"{str(dtype).removeprefix('torch.')}, 4 experts, one empty")


# --- FP8 --------------------------------------------------------------------------------------------
def check_fp8(device: str, recipe: str) -> tuple[str, str]:
    """The FP8 GEMMs `recipe` gets here (native where the GPU has the kernel, else emulated: same
    numerics), dense (fprop, dgrad, wgrad) and grouped, against float64 products of the unquantised
    operands: every element within the FP8 error bound of its sum of |terms|."""
    from gptoss_cli.fp8.selection import Fp8Settings, select_gemms
    from gptoss_cli.model.gemm.dense import linear
    from gptoss_cli.model.gemm.grouped import grouped_linear

    gemms = select_gemms(Fp8Settings(recipe=recipe, emulation=True), device)
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    x, w, dy = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((128, 256), (192, 256), (128, 192)))
    dense = gemms.dense("doctor")
    on = [t.to(device=device, dtype=dtype) for t in (x, w)]
    got = _grads(lambda a, b: linear(a, b, None, gemm=dense), ("dx", "dw"), on, dy)
    # per element: |x||w|^T for y, |dy||w| for dx, |dy|^T|x| for dw
    terms = {"out": x.abs() @ w.abs().t(), "dx": dy.abs() @ w.abs(), "dw": dy.abs().t() @ x.abs()}
    want = {"out": x @ w.t(), "dx": dy @ w, "dw": dy.t() @ x}
    ratio, where = _fp8_ratio(got, want, terms)
    counts = torch.tensor([48, 0, 80])
    we = torch.randn(3, 192, 256, generator=gen, dtype=torch.float64)
    grouped = gemms.grouped("doctor")
    y = grouped_linear(x.to(device, dtype), we.to(device, dtype), torch.zeros(3, 192, device=device, dtype=dtype),
                       counts.to(device), gemm=grouped).detach()
    rows = torch.split(x, counts.tolist())
    g_want = torch.cat([r @ we[e].t() for e, r in enumerate(rows)])
    g_terms = torch.cat([r.abs() @ we[e].abs().t() for e, r in enumerate(rows)])
    g_ratio, g_where = _fp8_ratio({"grouped out": y}, {"grouped out": g_want}, {"grouped out": g_terms})
    if g_ratio > ratio:
        ratio, where = g_ratio, g_where
    status = PASS if ratio <= 1.0 else FAIL
    return status, f"{gemms.describe()}; worst element {ratio:.2f} of the FP8 bound in {where}"


def _fp8_ratio(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
               terms: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest |got - want| / (FP8 bound) over the elements: (2u + u^2) x sum|terms| + bf16 output rounding."""
    worst, where = 0.0, ""
    for name, w in want.items():
        g = got[name].double().cpu()
        budget = (2 * U_E4M3 + U_E4M3**2) * terms[name] + U_BF16 * w.abs() + 1e-30
        ratio = float(((g - w).abs() / budget).max())
        if ratio >= worst:
            worst, where = ratio, name
    return worst, where


# --- collectives ------------------------------------------------------------------------------------
def check_collective(device: str, backend: str) -> tuple[str, str]:
    """One all_reduce through `backend` on a one-process group (gloo on CPU tensors; NCCL on the GPU):
    the library and the device initialise and run a collective."""
    import torch.distributed as dist

    if backend == "nccl" and (device == "cpu" or not dist.is_nccl_available()):
        return SKIP, "NCCL needs a CUDA GPU and a torch built with it"
    if not dist.is_available():
        return FAIL, "torch.distributed is not available in this build"
    if dist.is_initialized():
        return SKIP, "a process group already exists in this process"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.arange(8, dtype=torch.float32, device="cuda" if backend == "nccl" else "cpu")
        dist.all_reduce(t)
        if backend == "nccl":
            torch.cuda.synchronize()
        ok = torch.equal(t.cpu(), torch.arange(8, dtype=torch.float32))
    finally:
        dist.destroy_process_group()
    return (PASS if ok else FAIL), f"all_reduce on 1 process ({backend}{' ' + str(torch.cuda.nccl.version()) if backend == 'nccl' else ''})"


__all__ = ["Check", "PASS", "FAIL", "SKIP", "run_checks", "worst_error", "check_model", "check_attention",
           "check_grouped_gemm", "check_fp8", "check_collective"]
