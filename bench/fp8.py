"""Benchmark each FP8 recipe's expert GEMM (forward + backward) against bf16: time and error, one run.

The shape is one GPT-OSS 120B expert's fc1, `x [tokens, hidden] @ W [2 x intermediate, hidden]^T`
with its bias, through the grouped layer the model runs (`grouped_linear` with one local expert,
so MX's padding of the token group to 32 rows is included). 120B has hidden = intermediate = 2880
(a multiple of 32, not of 128); the CPU default scales it down by 3 to 960 and uses 500 tokens
(not a multiple of 32). `--hidden 2880 --tokens 4096 --device cuda` is the real shape.

Each round runs every recipe once, in turn (so machine noise hits all of them alike), and times
forward + backward (dx, dW, db); the table shows median times, the ratio to bf16 measured in the
same run, and the relative Frobenius error of y, dx and dW against an fp64 reference. On CPU
there is no FP8 hardware: tensorwise/rowwise run torch's reference `_scaled_mm` kernel and MXFP8
the dequantise + fp32 emulation, so the CPU ratios show only the emulation's overhead, never an
FP8 speed-up. On CUDA the path column says whether each recipe ran natively (sm90+ for
tensorwise/rowwise, sm100+ for MXFP8) or emulated.

    python bench/fp8.py
    python bench/fp8.py --device cuda --hidden 2880 --tokens 4096 --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gptoss_cli.fp8.catalog import RECIPES as FP8_RECIPES  # noqa: E402
from gptoss_cli.fp8.selection import Fp8Settings, select_gemms  # noqa: E402
from gptoss_cli.model.grouped_gemm import grouped_linear  # noqa: E402

RECIPES = ("bf16", *FP8_RECIPES)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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

    def run(recipe: str):
        x = x64.to(device, torch.bfloat16).requires_grad_(True)
        w = w64.to(device, torch.bfloat16).requires_grad_(True)
        b = b64.to(device, torch.bfloat16).requires_grad_(True)
        gemm = gemms[recipe].grouped("bench.linear_fc1") if gemms[recipe] is not None else None
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = grouped_linear(x, w, b, counts, gemm=gemm)
        y.backward(dy64.to(device, torch.bfloat16))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, y.detach(), x.grad, w.grad[0]

    times: dict[str, list[float]] = {r: [] for r in RECIPES}
    errors: dict[str, tuple[float, float, float]] = {}
    for i in range(args.rounds + 1):
        for recipe in RECIPES:
            dt, y, dx, dw = run(recipe)
            if i == 0:  # warm-up round: not timed; its results give the errors
                errors[recipe] = tuple(_rel(a, ref) for a, ref in ((y, ref_y), (dx, ref_dx), (dw, ref_dw)))
            else:
                times[recipe].append(dt)

    base = statistics.median(times["bf16"])
    print(f"expert fc1 forward + backward: tokens {args.tokens}, hidden {args.hidden}, out {2 * inter}, "
          f"bf16 activations, fp8_format={args.format}, device {device}, {args.threads} thread(s), "
          f"{args.rounds} rounds (medians)")
    print(f"{'recipe':<11} {'path':<30} {'ms':>9} {'x bf16':>7} {'err y':>8} {'err dx':>8} {'err dW':>8}")
    for recipe in RECIPES:
        g = gemms[recipe]
        path = "torch (no FP8)" if g is None else f"{g.path} ({g.numerics.kernel})"
        med = statistics.median(times[recipe])
        ey, edx, edw = errors[recipe]
        print(f"{recipe:<11} {path:<30} {med * 1e3:9.2f} {med / base:7.2f} {ey:8.4f} {edx:8.4f} {edw:8.4f}")
    if device.type == "cpu":
        print("CPU: no FP8 hardware, so these ratios measure only the emulation's overhead (quantise, "
              "dequantise or torch's reference _scaled_mm), never an FP8 speed-up.")


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error against the fp64 reference."""
    return ((a.double().cpu() - ref).norm() / ref.norm()).item()


if __name__ == "__main__":
    main()
