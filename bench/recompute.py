"""Benchmark activation recompute: step time and peak memory of each granularity against `none`.

In one run, on one model (the `wide` preset of bench/train.py by default) and one batch, for each
setting below: forward + backward of the training loss (chunked LM loss + aux loss), the time as
the median over --repeats of the median over --steps steps (after 2 warm-up steps), the settings
interleaved step by step inside each repeat (the order rotating); then, in a separate untimed pass, the peak memory of one step
(CUDA: torch.cuda.max_memory_allocated; CPU: every live storage counted by the dispatcher,
tests/recipe/live_bytes.py) and what the forward holds for backward. Prints medians and the ratios
to `none`, the baseline measured in the same run (the fastest setting: it repeats nothing).

    python bench/recompute.py --batch 2 --seq 512 --steps 3 --repeats 3 [--dtype bf16] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402
from bench.peers import bench_arch  # noqa: E402
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


def run(record: harness.Run, args: argparse.Namespace) -> dict:
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

    def side(plan):
        def step() -> None:
            model.set_recompute(plan)
            _step(model, ids)
            _sync(device)  # the step's kernels are done when its time is taken
        return step

    timed = harness.interleave({name: side(plan) for name, plan in plans.items()}, args.repeats, steps=args.steps,
                               warmup=2, clock="wall", before=lambda: _sync(device))
    case = f"{args.preset} batch {args.batch} x {args.seq} {args.dtype} {device.type}"
    record.add_rounds(case, timed)
    rows = {}
    for name, plan in plans.items():
        model.set_recompute(plan)
        peak, held = _memory(model, ids)
        record.add(case, name, "peak_bytes", peak)
        record.add(case, name, "held_bytes", held)
        rows[name] = {"step_s": timed.median(name), "peak_bytes": peak, "held_bytes": held}
    for name in plans:
        if name != "none":
            rows[name]["time_ratio"] = record.ratio(case, name, "none")["median"]
            rows[name]["peak_ratio"] = record.ratio(case, name, "none", "peak_bytes")["median"]
            rows[name]["held_ratio"] = record.ratio(case, name, "none", "held_bytes")["median"]
    rows["none"].update(time_ratio=1.0, peak_ratio=1.0, held_ratio=1.0)
    return {"preset": args.preset, "device": str(device), "settings": rows}


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--preset", default="wide", help="a model preset or `wide` (bench/peers.py)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="measured steps per repeat (after 2 warm-up steps)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    with harness.Run("recompute", args, clock="wall") as record:
        result = run(record, args)
    print(f"recompute on {result['preset']}, batch {args.batch} x seq {args.seq}, {args.dtype}, {result['device']}, "
          f"{args.threads} threads; medians of {args.repeats} repeats x {args.steps} steps; ratios to none")
    print(f"{'setting':30} {'step ms':>9} {'x none':>7} {'peak MB':>9} {'x none':>7} {'held MB':>9} {'x none':>7}")
    for name, r in result["settings"].items():
        print(f"{name:30} {1e3 * r['step_s']:9.1f} {r['time_ratio']:7.2f} {r['peak_bytes'] / 1e6:9.1f} "
              f"{r['peak_ratio']:7.2f} {r['held_bytes'] / 1e6:9.1f} {r['held_ratio']:7.2f}")
    record.finish()


if __name__ == "__main__":
    main()
