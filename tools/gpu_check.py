"""The prepared GPU check: one command, under 8 minutes on one H100/H200, nothing downloaded.

    bash tools/gpu_check.sh --json gpu_check.json          # on the GPU machine, from the checkout
    python tools/gpu_check.py --device cpu --dry            # here: the same code on tiny shapes

tools/gpu_check.sh first installs the pure-Python packages torch does not bring (omegaconf, typer, rich,
...) from `.whl/` (tools/offline_deps.py: `download` here, where PyPI is reachable; the folder travels
with the tree), then runs this script with the checkout on PYTHONPATH. It works with whatever torch
the machine has (2.6 or newer, CUDA).

In order, each printed as it finishes and all written to --json:
  1. `gptoss doctor` (gptoss_cli/doctor): versions, GPU, free memory, what each shipped recipe gets
     here, and the device checks against a float64 CPU reference: the tiny model's forward and
     backward, each attention backend (flash / flex / sdpa) on full, sliding-window and packed-document
     layers, the grouped GEMM, every FP8 recipe's GEMMs, NCCL and gloo. Every check must PASS (or be
     SKIPped with a reason).
  2. tiny-model training parity: 3 real training steps (provider, gradient buffers, distributed AdamW,
     the plain schedule) of the tiny preset on the device and on the CPU from the same weights and
     batch, fp32: the first step's loss agrees to fp32 rounding (same weights), the next ones to 1%
     (AdamW makes rounding-level gradient differences whole steps; tests/tolerances.py).
  3. GEMM throughput, medians of timed repeats (CUDA events): bf16 `x @ w.T` at GPT-OSS shapes and a
     square 8192^3 (the measured bf16 peak is the best of them), the experts' grouped GEMM
     (32 experts x 512 tokens, fc1 2880 -> 5760) in bf16, and each FP8 recipe's dense and grouped
     fprop through the fp8 package as training calls it (quantisation included), with FP8 / bf16.
  4. a 2-layer model at GPT-OSS width (hidden 2880, 32 experts top-4, 64 / 8 heads of 64, vocabulary
     201088; a sliding-window and a full-attention layer) trained `--steps` steps in bf16 at sequence
     4096 through the real training step: tokens/s, MFU against the measured bf16 peak (model FLOPs:
     gptoss_cli/recipe/estimate/flops.py), peak memory, and which attention kernel each layer kind got.
`--dry` runs all four on tiny shapes (any device, the CPU included: tests/test_gpu_check.py does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the project from this checkout, installed or not
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


# --- timing -------------------------------------------------------------------------------------
def median_seconds(fn: Callable[[], Any], device: str, repeats: int, warmup: int = 2) -> float:
    """Median wall time of `fn` over `repeats` runs after `warmup` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def say(line: str) -> None:
    print(line, flush=True)


# --- 1. doctor ----------------------------------------------------------------------------------
def run_doctor_step(device: str) -> dict[str, Any]:
    from gptoss_cli.doctor.report import run_doctor

    report = run_doctor(device)
    m = report.machine
    say(f"machine: torch {m.torch_version} CUDA {m.cuda_version} NCCL {m.nccl_version} driver {m.driver_version}; "
        f"{m.gpu_name or 'no GPU'} x {m.gpu_count} cap {m.capability} ({m.generation}); "
        f"free {m.gpu_memory_free_gb} of {m.gpu_memory_total_gb} GB")
    for r in report.recipes:
        refused = f"; refused: {'; '.join(r.refused)}" if r.refused else ""
        say(f"  recipe {r.recipe:<24} {r.params_dtype} fp8 {r.fp8:<28} attention {r.attention}{refused}")
    for c in report.checks:
        say(f"  check {c.name:<18} {c.status:<4} {c.seconds:6.1f} s  {c.detail}")
    say(f"doctor: {'all checks passed' if report.ok else f'{len(report.failed)} check(s) FAILED'}")
    return report.to_dict()


# --- 2. the training step, tiny parity ------------------------------------------------------------
def training_step(arch, device: str, dtype: str, seq: int, microbatches: int,
                  weights: dict[str, torch.Tensor] | None = None):
    """(model, step): one real training step of `arch` on `device` (the provider, gradient buffers and
    distributed AdamW of one process, the plain schedule) over `microbatches` rows of `seq` tokens;
    step(tokens [mb, seq+1]) -> the step's mean token loss."""
    from gptoss_cli.parallel.state import ParallelState
    from gptoss_cli.recipe.schema import RecipeConfig
    from gptoss_cli.schedule import get_forward_backward_func
    from gptoss_cli.train.data import Microbatch
    from gptoss_cli.train.objective import forward_step
    from gptoss_cli.model.pattern import default_pattern
    from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig
    from gptoss_cli.train.setup import install_training_callbacks, wrap_model_and_optimizer

    recipe = RecipeConfig()
    recipe.precision.params_dtype, recipe.moe.aux_loss_coeff = dtype, 0.0
    recipe.optimizer.weight_decay, recipe.optimizer.use_distributed_optimizer = 0.0, True
    state = ParallelState(device=torch.device(device))
    built = HybridModelProvider(ModelRuntimeConfig.from_recipe(recipe, arch, default_pattern(arch)), seed=0).provide(state)
    if weights is not None:
        built.load_state_dict(weights, strict=True)
    model, optimizer = wrap_model_and_optimizer(built, state, recipe.optimizer, 1e-4)
    schedule = get_forward_backward_func(install_training_callbacks(model, state))

    def step(tokens: torch.Tensor) -> float:
        tokens = tokens.to(device)
        mbs = [Microbatch(tokens=t[:, :-1].contiguous(), labels=t[:, 1:].contiguous()) for t in tokens.split(1)]
        model.zero_grad_buffer()
        logs = schedule(forward_step_func=forward_step, data_iterator=iter(mbs), model=model, num_microbatches=len(mbs))
        optimizer.step(1e-4)
        return float(sum(log["loss_sum"] for log in logs) / sum(log["num_tokens"] for log in logs))

    return built, step


def tiny_parity(device: str) -> dict[str, Any]:
    from gptoss_cli.model.config import preset

    arch = preset("tiny")
    tokens = [torch.randint(0, arch.vocab_size, (2, 33), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref_model, ref_step = training_step(arch, "cpu", "fp32", 32, 2)
    weights = {k: v.detach().clone() for k, v in ref_model.state_dict().items()}
    _, dut_step = training_step(arch, device, "fp32", 32, 2, weights)
    ref = [ref_step(t) for t in tokens]
    got = [dut_step(t) for t in tokens]
    rel = [abs(a - b) / abs(b) for a, b in zip(got, ref)]
    # step 1: same weights, fp32 sums over at most the vocabulary through the 6 layers and the head
    ok = rel[0] <= 4 * 8 * 1003 * 2.0**-24 and all(r <= 1e-2 for r in rel[1:])
    say(f"tiny training parity {device} vs cpu: losses {['%.6f' % x for x in got]} vs {['%.6f' % x for x in ref]}: "
        f"{'PASS' if ok else 'FAIL'}")
    return {"device_losses": got, "cpu_losses": ref, "relative_diff": rel, "ok": ok}


# --- 3. GEMM throughput ---------------------------------------------------------------------------
def gemm_throughput(device: str, dry: bool, repeats: int) -> dict[str, Any]:
    from gptoss_cli.errors import ConfigError
    from gptoss_cli.fp8.catalog import RECIPES
    from gptoss_cli.fp8.selection import Fp8Settings, select_gemms
    from gptoss_cli.model.gemm.grouped import DEFAULT_GEMM

    h, i, m, e, per = (64, 96, 256, 4, 64) if dry else (2880, 2880, 16384, 32, 512)
    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=bf16)  # noqa: E731
    x, w1, wo = mk(m, h), mk(2 * i, h), mk(h, h)
    xg, wg, counts = mk(e * per, h), mk(e, 2 * i, h), torch.full((e,), per, device=device)
    sq = 256 if dry else 8192
    a, b = mk(sq, sq), mk(sq, sq)
    rate = lambda flops, fn: flops / median_seconds(fn, device, repeats) / 1e12  # noqa: E731
    out: dict[str, Any] = {
        f"bf16 dense {m}x{h}x{2 * i}": rate(2 * m * h * 2 * i, lambda: x @ w1.t()),
        f"bf16 dense {m}x{h}x{h}": rate(2 * m * h * h, lambda: x @ wo.t()),
        f"bf16 square {sq}^3": rate(2 * sq**3, lambda: a @ b),
        f"bf16 grouped {e}x{per}x{h}x{2 * i}": rate(2 * e * per * h * 2 * i, lambda: DEFAULT_GEMM.fprop(xg, wg, counts)),
    }
    peak = max(out.values())
    fp8: dict[str, Any] = {}
    for recipe in RECIPES:
        try:  # native where the GPU has the kernel; on a CPU (the dry run) emulated, to exercise the code
            gemms = select_gemms(Fp8Settings(recipe=recipe, emulation=device == "cpu"), device)
        except ConfigError as exc:
            fp8[recipe] = {"refused": exc.message}
            continue
        dense, grouped = gemms.dense("bench"), gemms.grouped("bench")
        d = rate(2 * m * h * 2 * i, lambda: dense.fprop(x, w1))
        g = rate(2 * e * per * h * 2 * i, lambda: grouped.fprop(xg, wg, counts))
        fp8[recipe] = {"path": gemms.describe(), "dense_tflops": d, "grouped_tflops": g,
                       "dense_over_bf16": d / out[f"bf16 dense {m}x{h}x{2 * i}"],
                       "grouped_over_bf16": g / out[f"bf16 grouped {e}x{per}x{h}x{2 * i}"]}
    for name, tf in out.items():
        say(f"  {name:<34} {tf:8.1f} TFLOP/s")
    for recipe, r in fp8.items():
        say(f"  fp8 {recipe:<10} " + (f"refused: {r['refused']}" if "refused" in r else
                                     f"dense {r['dense_tflops']:.1f} TFLOP/s ({r['dense_over_bf16']:.2f}x bf16), grouped "
                                     f"{r['grouped_tflops']:.1f} ({r['grouped_over_bf16']:.2f}x), {r['path']}"))
    say(f"measured bf16 peak: {peak:.1f} TFLOP/s")
    return {"bf16_tflops": out, "bf16_peak_tflops": peak, "fp8": fp8}


# --- 4. the 2-layer model at GPT-OSS width --------------------------------------------------------
def wide_model_step(device: str, dry: bool, steps: int, seq: int, microbatches: int, peak_tflops: float) -> dict[str, Any]:
    from gptoss_cli.model.attention.backends import describe, layer_kernels
    from gptoss_cli.model.config import preset
    from gptoss_cli.recipe.estimate.flops import model_flops_per_token

    arch = preset("tiny") if dry else preset("gpt_oss_20b").replace(num_hidden_layers=2)
    seq = 32 if dry else seq
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    _, step = training_step(arch, device, "bf16", seq, microbatches)
    build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, arch.vocab_size, (microbatches, seq + 1), generator=gen) for _ in range(steps + 2)]
    losses = []
    it = iter(batches)
    step_s = median_seconds(lambda: losses.append(step(next(it))), device, steps, warmup=2)
    tokens = microbatches * seq
    flops = model_flops_per_token(arch, seq) * tokens
    window = arch.sliding_window
    kernels = layer_kernels("auto", device, torch.bfloat16, arch.head_dim, seq, window)
    result = {
        "arch": {"hidden": arch.hidden_size, "experts": arch.num_local_experts, "top_k": arch.num_experts_per_tok,
                 "layers": arch.num_hidden_layers, "vocab": arch.vocab_size, "seq": seq, "microbatches": microbatches},
        "build_s": build_s, "step_s": step_s, "tokens_per_s": tokens / step_s,
        "model_tflops_per_step": flops / 1e12, "mfu": flops / step_s / (peak_tflops * 1e12),
        "losses": losses, "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None,
        "attention": {kind: {"kernel": k, "what": describe(k, device)} for kind, k in kernels.items()},
    }
    say(f"2-layer GPT-OSS-width step ({arch.hidden_size} hidden, {arch.num_local_experts} experts top-"
        f"{arch.num_experts_per_tok}, seq {seq} x {microbatches}): {step_s * 1e3:.0f} ms, "
        f"{result['tokens_per_s']:.0f} tokens/s, MFU {result['mfu']:.1%} of the measured bf16 peak, "
        f"losses {['%.3f' % x for x in losses]}")
    for kind, k in result["attention"].items():
        say(f"  attention, {kind} layers: {k['what']}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dry", action="store_true", help="tiny shapes: check the script itself (any device)")
    p.add_argument("--steps", type=int, default=5, help="measured training steps of the 2-layer model")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20, help="timed repeats per GEMM")
    p.add_argument("--skip-doctor", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA GPU here: --device cpu --dry checks the script")
    start = time.perf_counter()
    results: dict[str, Any] = {"torch": torch.__version__, "device": args.device, "dry": args.dry}
    sections = [("doctor", lambda: None if args.skip_doctor else run_doctor_step(args.device)),
                ("tiny_parity", lambda: tiny_parity(args.device)),
                ("gemm", lambda: gemm_throughput(args.device, args.dry, 3 if args.dry else args.repeats))]
    ok = True
    for name, fn in sections:
        say(f"== {name}")
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - report it, go on with the next section
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            say(f"{name} FAILED: {type(exc).__name__}: {exc}")
            ok = False
    say("== wide_model")
    try:
        peak = (results.get("gemm") or {}).get("bf16_peak_tflops") or 1.0
        results["wide_model"] = wide_model_step(args.device, args.dry, args.steps, args.seq, args.microbatches, peak)
    except Exception as exc:  # noqa: BLE001
        results["wide_model"] = {"error": f"{type(exc).__name__}: {exc}"}
        say(f"wide_model FAILED: {type(exc).__name__}: {exc}")
        ok = False
    ok = ok and (results.get("doctor") or {"ok": True}).get("ok", False) and results["tiny_parity"].get("ok", False)
    results["ok"], results["seconds"] = ok, time.perf_counter() - start
    say(f"== {'ALL PASS' if ok else 'SOMETHING FAILED'} in {results['seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
