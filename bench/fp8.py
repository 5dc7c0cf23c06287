"""Benchmark each FP8 recipe's expert GEMM (forward + backward) against bf16: time and error, one run.

The shape is one GPT-OSS 120B expert's fc1, `x [tokens, hidden] @ W [2 x intermediate, hidden]^T`
with its bias, through the grouped layer the model runs (`grouped_linear` with one local expert,
so MX's padding of the token group to 32 rows is included). 120B has hidden = intermediate = 2880
(a multiple of 32, not of 128); the CPU default scales it down by 3 to 960 and uses 500 tokens
(not a multiple of 32). `--hidden 2880 --tokens 4096 --device cuda` is the real shape.

Each round runs every recipe once, the order rotating (so machine noise hits all of them alike), and times
forward + backward (dx, dW, db); the table shows median times, the ratio to bf16 measured in the
same run, and the relative Frobenius error of y, dx and dW against an fp64 reference. On CPU
there is no FP8 hardware: tensorwise/rowwise run torch's reference `_scaled_mm` kernel and MXFP8
the dequantise + fp32 emulation, so the CPU ratios show only the emulation's overhead, never an
FP8 speed-up. On CUDA the path column says whether each recipe ran natively (sm90+ for
tensorwise/rowwise, sm100+ for MXFP8) or emulated.

    python bench/fp8.py
    python bench/fp8.py --device cuda --hidden 2880 --tokens 4096 --rounds 20
    python bench/fp8.py --gemm-tflops --device cuda     # measure_gemm_tflops: FP8 vs bf16 TFLOP/s

`measure_gemm_tflops(device, ...)` is the same comparison as a function (tools/gpu_check.py calls
it): the forward GEMM of a dense layer and of a grouped expert layer, bf16 against each FP8 recipe
that runs natively on the device (emulated on a CPU), timed as training runs them (operands
quantised at every call) and, for the dense GEMM, the FP8 kernel alone on pre-quantised operands.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402
from gptoss_cli.errors import ConfigError  # noqa: E402
from gptoss_cli.fp8.catalog import RECIPES as FP8_RECIPES  # noqa: E402
from gptoss_cli.fp8.matmul import run_kernel  # noqa: E402
from gptoss_cli.fp8.scaling import quantize  # noqa: E402
from gptoss_cli.fp8.selection import Fp8Settings, select_gemms  # noqa: E402
from gptoss_cli.model.gemm.grouped import DEFAULT_GEMM, grouped_linear  # noqa: E402

RECIPES = ("bf16", *FP8_RECIPES)


def measure_gemm_tflops(device: str | torch.device = "cuda", *, tokens: int = 8192, hidden: int = 2880,
                        out_features: int = 5760, experts: int = 8, recipes: tuple[str, ...] = RECIPES,
                        fp8_format: str = "e4m3", rounds: int = 10, warmup: int = 3) -> list[dict]:
    """FP8 against bf16 GEMM throughput on `device`, one row per (GEMM, recipe, timing).

    GEMMs: "dense", `x [tokens, hidden] @ W [out_features, hidden]^T`; "grouped", the same rows
    split evenly over `experts`, each expert its own `W_e` (the model's grouped layer: one
    `torch._grouped_mm` in bf16; for FP8 one `torch._scaled_grouped_mm` where fp8/grouped_kernel.py
    takes it, else the per-expert loop). FLOPs are 2 x tokens x hidden x out_features either way.
    Timings: "as trained", both operands quantised at every call (what a training step pays); for
    the dense GEMM also "kernel", the FP8 kernel alone on operands quantised once. bf16 rows are the
    baseline of their GEMM. Recipes without a native kernel on a GPU (MXFP8 before Blackwell) get a
    row with `skipped` set; on a CPU every FP8 recipe is emulated (no FP8 speed-up to measure).

    Each row: {"gemm", "recipe", "timing", "path", "kernel", "ms" (median of `rounds` after `warmup`),
    "tflops", "x_bf16" (time of bf16 / time of this row: > 1 is faster than bf16), "skipped"}.
    """
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(out_features, hidden, generator=g) / hidden**0.5).to(device, torch.bfloat16)
    we = (torch.randn(experts, out_features, hidden, generator=g) / hidden**0.5).to(device, torch.bfloat16)
    counts = torch.full((experts,), tokens // experts, dtype=torch.long)
    counts[: tokens % experts] += 1
    counts = counts.to(device)
    flops = 2.0 * tokens * hidden * out_features
    rows: list[dict] = []
    base: dict[str, float] = {}
    for recipe in recipes:
        if recipe == "bf16":
            cases = [("dense", "as trained", lambda: x @ w.t()),
                     ("grouped", "as trained", lambda: DEFAULT_GEMM.fprop(x, we, counts))]
            path, kernel = "torch", "mm / _grouped_mm"
        else:
            try:
                gemms = select_gemms(Fp8Settings(recipe, fp8_format, emulation=device.type == "cpu"), device)
            except ConfigError as exc:
                rows.append({"gemm": "dense, grouped", "recipe": recipe, "timing": "-", "path": "-", "kernel": "-",
                             "ms": None, "tflops": None, "x_bf16": None, "skipped": str(exc)})
                continue
            dense, grouped = gemms.dense("bench.dense"), gemms.grouped("bench.grouped")
            qa = quantize(x, gemms.numerics.forward, gemms.numerics.scaling)
            qb = quantize(w, gemms.numerics.forward, gemms.numerics.scaling)
            cases = [("dense", "as trained", lambda: dense.fprop(x, w)),
                     ("dense", "kernel", lambda: run_kernel(gemms.numerics.kernel, qa, qb, torch.bfloat16)),
                     ("grouped", "as trained", lambda: grouped.fprop(x, we, counts))]
            path, kernel = gemms.path, gemms.numerics.kernel
            fmt = gemms.numerics.forward
            grouped_kernel = grouped.uses_grouped_kernel(x, fmt, fmt, hidden, out_features, experts)
        for gemm, timing, fn in cases:
            if recipe != "bf16" and gemm == "grouped":
                kernel = "_scaled_grouped_mm" if grouped_kernel else f"{gemms.numerics.kernel} per expert"
            ms = _median_ms(fn, device, rounds, warmup)
            if recipe == "bf16":
                base[gemm] = ms
            rows.append({"gemm": gemm, "recipe": recipe, "timing": timing, "path": path, "kernel": kernel, "ms": ms,
                         "tflops": flops / (ms * 1e-3) / 1e12, "x_bf16": base.get(gemm, ms) / ms, "skipped": None})
    return rows


def _median_ms(fn, device: torch.device, rounds: int, warmup: int) -> float:
    """Median milliseconds of `fn` (CUDA events on a GPU, wall clock elsewhere; bench/harness.py)."""
    timed = harness.interleave({"fn": fn}, rounds, warmup=warmup, clock="cuda" if device.type == "cuda" else "wall")
    return 1e3 * timed.median("fn")


def print_gemm_tflops(rows: list[dict]) -> None:
    print(f"{'gemm':<8} {'recipe':<11} {'timing':<11} {'path':<9} {'kernel':<17} {'ms':>8} {'TFLOP/s':>8} {'x bf16':>7}")
    for r in rows:
        if r["skipped"]:
            print(f"{r['gemm']:<8} {r['recipe']:<11} skipped: {r['skipped']}")
            continue
        print(f"{r['gemm']:<8} {r['recipe']:<11} {r['timing']:<11} {r['path']:<9} {r['kernel']:<17} {r['ms']:8.3f} "
              f"{r['tflops']:8.1f} {r['x_bf16']:7.2f}")


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--gemm-tflops", action="store_true", help="FP8 vs bf16 GEMM and grouped-GEMM TFLOP/s instead")
    p.add_argument("--experts", type=int, default=8, help="--gemm-tflops: experts of the grouped GEMM")
    p.add_argument("--tokens", type=int, default=500)
    p.add_argument("--hidden", type=int, default=960)
    p.add_argument("--intermediate", type=int, default=None, help="default: the hidden size (as in 120B)")
    p.add_argument("--format", default="hybrid", choices=["e4m3", "hybrid"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = "cuda" if device.type == "cuda" else "wall"
    if args.gemm_tflops:
        print(f"forward GEMM, tokens {args.tokens}, hidden {args.hidden}, out {2 * (args.intermediate or args.hidden)}, "
              f"{args.experts} experts for the grouped one, fp8_format={args.format}, device {device}, "
              f"{args.rounds} rounds (medians)")
        with harness.Run("fp8 --gemm-tflops", args, clock=clock) as run:
            rows = measure_gemm_tflops(device, tokens=args.tokens, hidden=args.hidden,
                                       out_features=2 * (args.intermediate or args.hidden), experts=args.experts,
                                       fp8_format=args.format, rounds=args.rounds)
        print_gemm_tflops(rows)
        for r in rows:
            if not r["skipped"]:
                run.add(f"{r['gemm']} {r['timing']}", r["recipe"], "tflops", r["tflops"])
        run.extra["rows"] = rows
        run.finish()
        return
    with harness.Run("fp8", args, clock=clock) as run:
        errors, gemms = expert_fc1_rounds(run, args, device, clock)
    inter = args.intermediate or args.hidden
    case = f"expert fc1 {args.tokens} x {args.hidden} -> {2 * inter}"
    print(f"expert fc1 forward + backward: tokens {args.tokens}, hidden {args.hidden}, out {2 * inter}, "
          f"bf16 activations, fp8_format={args.format}, device {device}, {args.threads} thread(s), "
          f"{args.rounds} rounds (medians)")
    print(f"{'recipe':<11} {'path':<30} {'ms':>9} {'x bf16':>7} {'err y':>8} {'err dx':>8} {'err dW':>8}")
    for recipe in RECIPES:
        g = gemms[recipe]
        path = "torch (no FP8)" if g is None else f"{g.path} ({g.numerics.kernel})"
        med = run.cases[case]["settings"][recipe]["time_s"]["median"]
        ratio = run.ratio(case, recipe, "bf16")["median"] if recipe != "bf16" else 1.0
        ey, edx, edw = errors[recipe]
        print(f"{recipe:<11} {path:<30} {med * 1e3:9.2f} {ratio:7.2f} {ey:8.4f} {edx:8.4f} {edw:8.4f}")
    run.extra["relative_errors_y_dx_dw"] = errors
    if device.type == "cpu":
        print("CPU: no FP8 hardware, so these ratios measure only the emulation's overhead (quantise, "
              "dequantise or torch's reference _scaled_mm), never an FP8 speed-up.")
    run.finish()


def expert_fc1_rounds(run: harness.Run, args, device: torch.device, clock: str) -> tuple[dict, dict]:
    """Every recipe's expert fc1 forward + backward in interleaved rounds, recorded in `run`; the
    relative errors of each against the fp64 reference (from an untimed first call), and the GEMMs."""
    inter = args.intermediate or args.hidden
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(args.tokens, args.hidden, generator=g, dtype=torch.float64)
    w64 = torch.randn(1, 2 * inter, args.hidden, generator=g, dtype=torch.float64) / args.hidden**0.5
    b64 = torch.randn(1, 2 * inter, generator=g, dtype=torch.float64)
    dy64 = torch.randn(args.tokens, 2 * inter, generator=g, dtype=torch.float64)
    counts = torch.tensor([args.tokens], device=device)
    ref_y = x64 @ w64[0].t() + b64[0]
    ref_dx, ref_dw = dy64 @ w64[0], dy64.t() @ x64

    gemms = {"bf16": None}
    for recipe in RECIPES[1:]:
        gemms[recipe] = select_gemms(Fp8Settings(recipe, args.format, emulation=True), device)

    def forward_backward(recipe: str):
        x = x64.to(device, torch.bfloat16).requires_grad_(True)
        w = w64.to(device, torch.bfloat16).requires_grad_(True)
        b = b64.to(device, torch.bfloat16).requires_grad_(True)
        gemm = gemms[recipe].grouped("bench.linear_fc1") if gemms[recipe] is not None else None
        _, timed = harness.measure(lambda: grouped_linear(x, w, b, counts, gemm=gemm).backward(
            dy64.to(device, torch.bfloat16)), clock)
        return timed

    errors: dict[str, tuple[float, float, float]] = {}
    for recipe in RECIPES:  # the warm-up call: not timed; its results give the errors
        x = x64.to(device, torch.bfloat16).requires_grad_(True)
        w = w64.to(device, torch.bfloat16).requires_grad_(True)
        b = b64.to(device, torch.bfloat16).requires_grad_(True)
        gemm = gemms[recipe].grouped("bench.linear_fc1") if gemms[recipe] is not None else None
        y = grouped_linear(x, w, b, counts, gemm=gemm)
        y.backward(dy64.to(device, torch.bfloat16))
        errors[recipe] = tuple(_rel(a, ref) for a, ref in ((y.detach(), ref_y), (x.grad, ref_dx), (w.grad[0], ref_dw)))
    timed = harness.interleave({r: (lambda r=r: forward_backward(r)) for r in RECIPES}, args.rounds, warmup=0,
                               clock="wall")
    run.add_rounds(f"expert fc1 {args.tokens} x {args.hidden} -> {2 * inter}", timed)
    return errors, gemms


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error against the fp64 reference."""
    return ((a.double().cpu() - ref).norm() / ref.norm()).item()


if __name__ == "__main__":
    main()
