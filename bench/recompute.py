"""Benchmark activation recompute: step time and peak memory of each granularity against `none`.

In one run, on one model (the `wide` preset of bench/train.py by default) and one batch, for each
setting below: forward + backward of the training loss (chunked LM loss + aux loss), the time as
the median over --repeats of the median over --steps steps (after 2 warm-up steps), the settings
interleaved inside each repeat; then, in a separate untimed pass, the peak memory of one step
(CUDA: torch.cuda.max_memory_allocated; CPU: every live storage counted by the dispatcher,
tests/recipe/live_bytes.py) and what the forward holds for backward. Prints medians and the ratios
to `none`, the baseline measured in the same run (the fastest setting: it repeats nothing).

    python bench/recompute.py --batch 2 --seq 512 --steps 3 --repeats 3 [--dtype bf16] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.train import bench_arch  # noqa: E402
from gptoss_cli.model.hybrid import HybridModel  # noqa: E402
from gptoss_cli.model.recompute_plan import RecomputePlan  # noqa: E402

SETTINGS = {
    "none": ("none", (), None, None),
    "selective core_attn": ("selective", ("core_attn",), None, None),
    "selective moe_act,layernorm": ("selective", ("moe_act", "layernorm"), None, None),
    "selective moe,layernorm": ("selective", ("moe", "layernorm"), None, None),
    "full uniform 2": ("full", (), "uniform", 2),
    "full block 2": ("full", (), "block", 2),
}


def _step(model: HybridModel, ids: torch.Tensor) -> None:
    out = model(ids[:, :-1])
    loss = out.lm_loss_sum(ids[:, 1:])
    if out.aux_loss is not None:
        loss = loss + out.aux_loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_step(model: HybridModel, ids: torch.Tensor, steps: int) -> float:
    for _ in range(2):
        _step(model, ids)
    times = []
    for _ in range(steps):
        _sync(ids.device)
        t0 = time.perf_counter()
        _step(model, ids)
        _sync(ids.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _memory(model: HybridModel, ids: torch.Tensor) -> tuple[float, float]:
    """(peak bytes of one step, bytes held for backward after the forward) above what was live before."""
    gc.collect()
    if ids.is_cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = model(ids[:, :-1])
        loss = out.lm_loss_sum(ids[:, 1:]) + (out.aux_loss if out.aux_loss is not None else 0)
        del out
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        model.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated() - base, held
    from tests.recipe.live_bytes import LiveBytes

    with LiveBytes() as live:
        out = model(ids[:, :-1])
        loss = out.lm_loss_sum(ids[:, 1:]) + (out.aux_loss if out.aux_loss is not None else 0)
        del out
        gc.collect()
        held = live.current
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    return live.peak, held


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    arch = bench_arch(args.preset)
    torch.manual_seed(0)
    model = HybridModel(arch, dtype=dtype, device=device).train()
    model.aux_loss_coef = 0.01
    ids = torch.randint(0, arch.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    layers = len(model.pattern.layers)
    plans = {name: RecomputePlan.from_settings(g, m, meth, n, layers) for name, (g, m, meth, n) in SETTINGS.items()}
    times: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(args.repeats):
        for name, plan in plans.items():  # interleaved: drift hits every setting alike
            model.set_recompute(plan)
            times[name].append(_median_step(model, ids, args.steps))
    rows = {}
    for name, plan in plans.items():
        model.set_recompute(plan)
        peak, held = _memory(model, ids)
        rows[name] = {"step_s": statistics.median(times[name]), "peak_bytes": peak, "held_bytes": held}
    base = rows["none"]
    for r in rows.values():
        r["time_ratio"] = r["step_s"] / base["step_s"]
        r["peak_ratio"] = r["peak_bytes"] / base["peak_bytes"]
        r["held_ratio"] = r["held_bytes"] / base["held_bytes"]
    return {"preset": args.preset, "batch": args.batch, "seq": args.seq, "dtype": args.dtype, "device": str(device),
            "threads": args.threads, "steps": args.steps, "repeats": args.repeats, "settings": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="wide", help="a model preset or `wide` (bench/train.py)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="measured steps per repeat (after 2 warm-up steps)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    result = run(args)
    print(f"recompute on {result['preset']}, batch {args.batch} x seq {args.seq}, {args.dtype}, {result['device']}, "
          f"{args.threads} threads; medians of {args.repeats} repeats x {args.steps} steps; ratios to none")
    print(f"{'setting':30} {'step ms':>9} {'x none':>7} {'peak MB':>9} {'x none':>7} {'held MB':>9} {'x none':>7}")
    for name, r in result["settings"].items():
        print(f"{name:30} {1e3 * r['step_s']:9.1f} {r['time_ratio']:7.2f} {r['peak_bytes'] / 1e6:9.1f} "
              f"{r['peak_ratio']:7.2f} {r['held_bytes'] / 1e6:9.1f} {r['held_ratio']:7.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
