"""Benchmark the clamped SwiGLU: the eager autograd Function against the compiled single-pass kernels.

In one run, one thread, on the activation shapes of a training step: [4096, 2 x 512] (the 512
config and the `wide` preset of bench/train.py at batch 2 x seq 512 x top-4; I = 512) and GPT-OSS's
own width [1024, 2 x 2880], in fp32 and bf16, for each of
  * forward + backward: `clamped_swiglu(gate_up)` with autograd, then the input gradient;
  * forward only (no grad: recompute's second forward, inference);
the two kernels alternate within every round (eager, compiled, compiled, eager, ...), each round's
time the CPU time of this process (`--clock cpu`, the default: on a shared host it measures the
work). Prints per setting the medians, the ratio eager / compiled per repeat (median of that
repeat's rounds; their median, min and max), and the first compiled call of each dtype (importing
torch._dynamo and Inductor, compiling or loading both kernels from Inductor's cache).

`--model wide` (or `--model 512`: hidden 512, intermediate 512, 16 experts top-4 on the tiny
preset) also times the model's forward + backward of the training loss (as bench/recompute.py) at
`--batch 2 --seq 512`: one model, one batch, the kernel switched between the alternating steps
(`HybridModel.set_swiglu_kernel`), freed memory kept in the heap as `gptoss train` does on the CPU;
both losses are printed (they agree to fp32 rounding).

`--whole-mlp` also tries `torch.compile` on the whole experts body (`GroupedExperts._mlp`: fc1,
activation, fc2) and prints whether it compiles and, if so, its time against eager.

    python bench/swiglu.py [--steps 10] [--repeats 3] [--dtype fp32 --dtype bf16] [--whole-mlp] [--json out.json]
    python bench/swiglu.py --model wide --model 512 --dtype fp32 --no-kernels --steps 3 --repeats 3
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402
from gptoss_cli.model.mlp import clamped_swiglu  # noqa: E402

LIMIT, ALPHA = 7.0, 1.702
SHAPES = {"512 config / wide [4096, 2x512]": (4096, 512), "GPT-OSS width [1024, 2x2880]": (1024, 2880)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CLOCK = "cpu"


def _fwd_bwd(kernel: str, gate_up: torch.Tensor, dy: torch.Tensor):
    def run() -> None:
        x = gate_up.detach().requires_grad_()
        torch.autograd.grad(clamped_swiglu(x, LIMIT, ALPHA, kernel), x, dy)
    return run


def _fwd(kernel: str, gate_up: torch.Tensor, _dy: torch.Tensor):
    def run() -> None:
        with torch.no_grad():
            clamped_swiglu(gate_up, LIMIT, ALPHA, kernel)
    return run


def compare(run: harness.Run, case: str, eager, compiled, steps: int, repeats: int) -> dict:
    """Alternating steps of the two (bench/harness.py), recorded as `case`; the medians and the
    per-repeat ratios eager / compiled."""
    timed = harness.interleave({"eager": eager, "compiled": compiled}, repeats, steps=steps, warmup=1, clock=CLOCK)
    run.add_rounds(case, timed)
    ratio = run.ratio(case, "eager", "compiled")
    return {"eager_ms": 1e3 * timed.median("eager"), "compiled_ms": 1e3 * timed.median("compiled"),
            "ratio": ratio["median"], "ratio_min": ratio["min"], "ratio_max": ratio["max"]}


def first_call_s(dtype: torch.dtype) -> float:
    """Wall time of the first compiled call of this dtype: the verdict probe compiles (or loads) both kernels."""
    x = torch.randn(64, 64, dtype=dtype, requires_grad=True)
    t0 = time.perf_counter()
    clamped_swiglu(x, LIMIT, ALPHA, "auto").sum().backward()
    return time.perf_counter() - t0


def whole_mlp(run: harness.Run, steps: int, repeats: int) -> dict:
    """torch.compile of GroupedExperts._mlp on the `wide` experts, fp32: compiles or not, and how fast."""
    from bench.peers import bench_arch
    from gptoss_cli.model.moe import GroupedExperts

    arch = bench_arch("wide")
    experts = GroupedExperts(arch, arch.num_local_experts, 0)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    rows = 4096
    x = torch.randn(rows, arch.hidden_size)
    counts = torch.full((arch.num_local_experts,), rows // arch.num_local_experts)
    dy = torch.randn(rows, arch.hidden_size)
    compiled_mlp = torch.compile(experts._mlp, dynamic=True)

    def step(body):
        def run() -> None:
            xg = x.detach().requires_grad_()
            torch.autograd.grad(body(xg, counts, None, "mlp.experts", False), [xg, *experts.parameters()], dy)
        return run

    try:
        step(compiled_mlp)()
    except Exception as exc:  # noqa: BLE001 - the result is whether it compiles
        lines = str(exc).strip().splitlines() or [""]
        why = next((ln.strip() for ln in lines if "): got RuntimeError(" in ln), lines[0]).split("): got ", 1)[-1]
        return {"compiles": False, "error": f"{type(exc).__name__}: {why[:200]}"}
    return {"compiles": True, **compare(run, "whole experts body, wide, fp32", step(experts._mlp), step(compiled_mlp),
                                        steps, repeats)}


MODELS = {"wide": ("wide", None),
          "512": ("tiny", "hidden_size=512,intermediate_size=512,num_local_experts=16,num_experts_per_tok=4")}


def model_step(record: harness.Run, name: str, dtype: torch.dtype, batch: int, seq: int, steps: int,
               repeats: int) -> dict:
    """The model's forward + backward with each kernel, alternating; the same weights and batch."""
    from bench.train import _arch, _batch
    from gptoss_cli.model.hybrid import HybridModel
    from gptoss_cli.model.init import init_weights_
    from gptoss_cli.resources import keep_freed_memory

    keep_freed_memory()  # as `gptoss train` does on the CPU (and bench/train.py)

    arch = _arch(*MODELS[name])
    model = HybridModel(arch, dtype=dtype).train()
    init_weights_(model, arch.initializer_range, 0)
    ids = _batch(arch, batch, seq)
    losses = {}

    def run(kernel: str):
        def step() -> None:
            model.set_swiglu_kernel(kernel)
            loss = model(ids[:, :-1]).lm_loss_sum(ids[:, 1:])
            loss.backward()
            model.zero_grad(set_to_none=True)
            losses[kernel] = float(loss.detach()) / ids[:, 1:].numel()
        return step

    r = compare(record, f"model {name} {str(dtype).removeprefix('torch.')} batch {batch} x {seq}", run("eager"),
                run("auto"), steps, repeats)
    return {"model": name, "dtype": str(dtype).removeprefix("torch."), "batch": batch, "seq": seq, **r,
            "loss_eager": losses["eager"], "loss_compiled": losses["auto"]}


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--steps", type=int, default=10, help="rounds per repeat (after one warm-up)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", action="append", choices=tuple(DTYPES), help="repeatable; default fp32 and bf16")
    p.add_argument("--clock", default="cpu", choices=tuple(harness.CLOCKS))
    p.add_argument("--model", action="append", choices=tuple(MODELS),
                   help="also time the model's forward + backward with each kernel (repeatable)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--no-kernels", dest="kernels", action="store_false",
                   help="skip the activation-only timings (with --model: only the model's step)")
    p.add_argument("--whole-mlp", action="store_true", help="also try torch.compile of the whole experts body")
    args = p.parse_args()
    global CLOCK
    CLOCK = args.clock
    torch.set_num_threads(1)
    if os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1":
        raise SystemExit("bench: TORCH_COMPILE_DISABLE=1 is set; the compiled kernels would not run")
    run = harness.Run("swiglu", args).__enter__()
    result: dict = {"threads": 1, "first_call_s": {}, "settings": []}
    for dname in args.dtype or ["fp32", "bf16"]:
        dtype = DTYPES[dname]
        result["first_call_s"][dname] = first_call_s(dtype)
        print(f"{dname}: first compiled call {result['first_call_s'][dname]:.1f} s (import, compile or cache load)")
        for sname in SHAPES if args.kernels else ():
            rows, inter = SHAPES[sname]
            g = torch.Generator().manual_seed(0)
            gate_up = (4 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)
            dy = torch.randn(rows, inter, generator=g).to(dtype)
            for pass_name, make in (("forward+backward", _fwd_bwd), ("forward", _fwd)):
                r = compare(run, f"{sname} {dname} {pass_name}", make("eager", gate_up, dy), make("auto", gate_up, dy),
                            args.steps, args.repeats)
                result["settings"].append({"shape": sname, "dtype": dname, "pass": pass_name, **r})
    for name in args.model or []:
        for dname in args.dtype or ["fp32"]:
            result.setdefault("models", []).append(
                model_step(run, name, DTYPES[dname], args.batch, args.seq, args.steps, args.repeats))
    if args.whole_mlp:
        result["whole_mlp"] = whole_mlp(run, args.steps, args.repeats)
    print(f"{'shape':<32} {'dtype':<5} {'pass':<17} {'eager ms':>9} {'compiled ms':>12} {'ratio':>6}  min-max")
    for s in result["settings"]:
        print(f"{s['shape']:<32} {s['dtype']:<5} {s['pass']:<17} {s['eager_ms']:>9.2f} {s['compiled_ms']:>12.2f} "
              f"{s['ratio']:>6.2f}  {s['ratio_min']:.2f}-{s['ratio_max']:.2f}")
    for m in result.get("models", []):
        print(f"model {m['model']} {m['dtype']} batch {m['batch']} x seq {m['seq']}, forward+backward: eager "
              f"{m['eager_ms']:.0f} ms, compiled {m['compiled_ms']:.0f} ms, ratio {m['ratio']:.3f} "
              f"({m['ratio_min']:.3f}-{m['ratio_max']:.3f}); loss {m['loss_eager']:.6f} / {m['loss_compiled']:.6f}")
    if args.whole_mlp:
        w = result["whole_mlp"]
        print("whole experts body compiled (wide, fp32): " + (
            f"eager {w['eager_ms']:.1f} ms, compiled {w['compiled_ms']:.1f} ms, ratio {w['ratio']:.2f}"
            if w["compiles"] else f"does not compile ({w['error']})"))
    run.extra.update(result)
    run.finish()


if __name__ == "__main__":
    main()
