"""Benchmark the EP all-to-all overlap schedule (issue 6) against the plain schedule, same run, same data.

Two gloo processes, EP=2, a widened tiny GPT-OSS (fp32 on CPU), one model and one fixed global
batch; each round times one training step (forward + backward + finalize_model_grads, no
optimizer) with each schedule in turn:
  * plain      gptoss_cli.schedule.plain.forward_backward_no_pipelining (what overlap=false runs)
  * plan       the combined-1F1B plans run one microbatch after the other (interleave=False):
               the cost of splitting the model into nodes, with nothing hidden
  * overlap    combined 1F1B, F(i) interleaved with B(i-1), delayed expert wgrad
(bench/harness.py: rounds in rotating order, per-round ratios) and prints median step times, the
ratios overlap/plain and overlap/plan, and the fraction of the
all-to-all time hidden behind compute, from the collectives' own timings: for every all-to-all,
in flight = issue -> wait returned, blocked = time inside wait(); hidden = 1 - blocked/in flight.

On CPU the "network" is gloo over loopback: its copies run on gloo threads that share the same
cores as the compute, so what overlap can gain here is small; the number is reported as measured.
With --device cuda (needs 2 GPUs: NCCL cannot put two ranks on one GPU) waits synchronise so
blocked time is real.

    python bench/overlap.py --microbatches 8 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402


class OverlapStats:
    """The overlap schedule's observer (gptoss_cli/model/schedule_plan.py, `ScheduleObserver`):
    every all-to-all's own timings and the delayed-wgrad work done.

    For every all-to-all: in flight = issue -> wait returned, blocked = time inside the issuing call
    and inside wait(). With `sync` (CUDA), wait() synchronises the stream so blocked time is real."""

    def __init__(self, sync: bool = False):
        self.sync = sync
        self.comms: list[tuple[str, float, float]] = []  # (node, in flight s, blocked s)
        self.wgrad_gemms = 0

    def all_to_all(self, name: str, issue: Callable[[], Any]) -> "_TimedWait":
        issued = time.perf_counter()
        handle = issue()
        return _TimedWait(self, name, handle, issued, time.perf_counter())

    def delayed_wgrad(self, executed: int) -> None:
        self.wgrad_gemms += executed

    @property
    def in_flight_s(self) -> float:
        return sum(c[1] for c in self.comms)

    @property
    def blocked_s(self) -> float:
        return sum(c[2] for c in self.comms)

    @property
    def hidden_fraction(self) -> float:
        """Share of the all-to-all time (issue to wait returning) not spent blocked in wait."""
        total = self.in_flight_s
        return 1.0 - self.blocked_s / total if total > 0 else 0.0


class _TimedWait:
    def __init__(self, stats: OverlapStats, name: str, handle: Any, issued: float, issue_returned: float):
        self.stats, self.name, self.handle, self.issued, self.issue_returned = stats, name, handle, issued, issue_returned

    def wait(self) -> torch.Tensor:
        started = time.perf_counter()
        out = self.handle.wait()
        if self.stats.sync and out.is_cuda:
            torch.cuda.current_stream().synchronize()
        done = time.perf_counter()
        self.stats.comms.append((self.name, done - self.issued, (self.issue_returned - self.issued) + (done - started)))
        return out


def add_model_args(ap: argparse.ArgumentParser, microbatches: int, micro_batch: int) -> None:
    """The benchmarked model's options (shared with bench/overlap_replay.py)."""
    ap.add_argument("--microbatches", type=int, default=microbatches)
    ap.add_argument("--micro-batch", type=int, default=micro_batch)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--pattern", default=None, help="hybrid_layer_pattern (default: the preset's, *E*E*E)")


def build_model(args: dict, state):
    """(arch, setup, data source): the tiny model widened by `args`, in train mode, built for the
    overlap schedule with delayed wgrad at `state`'s EP size, and its mock data."""
    from gptoss_cli.model.config import preset
    from gptoss_cli.model.pattern import default_pattern, parse_pattern
    from gptoss_cli.recipe.schema import RecipeConfig
    from gptoss_cli.train.data import MockSource
    from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig
    from gptoss_cli.train.setup import setup_model_and_optimizer

    arch = preset("tiny").replace(hidden_size=args["hidden"], intermediate_size=args["intermediate"],
                                  num_local_experts=args["experts"], num_experts_per_tok=2)
    cfg = RecipeConfig()
    cfg.precision.params_dtype, cfg.moe.aux_loss_coeff = "fp32", 0.001
    cfg.parallelism.expert_model_parallel_size = state.ep_size
    cfg.overlap.overlap_moe_expert_parallel_comm = cfg.overlap.delay_wgrad_compute = True
    runtime = ModelRuntimeConfig.from_recipe(
        cfg, arch, parse_pattern(args["pattern"]) if args["pattern"] else default_pattern(arch))
    setup = setup_model_and_optimizer(HybridModelProvider(runtime, seed=1), state, cfg.optimizer, cfg.training.lr)
    setup.model.train()
    return arch, setup, MockSource(arch.vocab_size, args["seq"], seed=3)


def worker(rank: int, args: dict) -> dict:
    from tests.support.simlink import LinkModel, use_link
    from gptoss_cli.parallel.state import init_parallel
    from gptoss_cli.schedule.combined_1f1b import forward_backward_combined_1f1b
    from gptoss_cli.schedule.plain import forward_backward_no_pipelining
    from gptoss_cli.train.data import DataLoaderState
    from gptoss_cli.train.objective import forward_step

    torch.set_num_threads(args["threads"])
    state = init_parallel(2, args["device"])
    arch, setup, source = build_model(args, state)
    model = setup.model
    mb = args["micro_batch"]
    n = args["microbatches"]

    def step(kind: str, link: tuple[float, float] | None) -> dict:
        # The same global batch every time: position 0 of the data.
        data = DataLoaderState(source, global_batch_size=mb * n * state.dp_size, micro_batch_size=mb,
                               dp_rank=state.dp_rank, dp_size=state.dp_size, device=state.device)
        stats = OverlapStats(sync=state.device.type == "cuda") if kind != "plain" else None
        # A fresh link per step (an empty queue); without a simulated link one of infinite
        # bandwidth and no latency still counts the bytes.
        model_link = LinkModel(*link) if link else LinkModel(float("inf"), 0.0)
        model.zero_grad_buffer()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with use_link(model, model_link):
            if kind == "plain":
                forward_backward_no_pipelining(forward_step_func=forward_step, data_iterator=data.step_iterator(),
                                               model=model, num_microbatches=n)
            else:
                forward_backward_combined_1f1b(forward_step_func=forward_step, data_iterator=data.step_iterator(),
                                               model=model, num_microbatches=n, interleave=kind == "overlap",
                                               observer=stats)
        if state.device.type == "cuda":
            torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=state.device)
        torch.distributed.all_reduce(dt, op=torch.distributed.ReduceOp.MAX)  # the step ends when both ranks end
        return {"time_s": float(dt), "modeled_s": model_link.modeled_s, "blocked_s": model_link.blocked_s,
                "bytes": model_link.bytes_moved, "bulk": model_link.counts["bulk"],
                "control": model_link.counts["control"]}

    kinds = ["plain", "overlap"] if args["no_plan"] else ["plain", "plan", "overlap"]

    def measure(link: tuple[float, float] | None) -> dict[str, dict[str, list[float]]]:
        """Per schedule and metric, one value per round; no schedule always runs first (bench/harness.py)."""
        sides = {kind: (lambda kind=kind: step(kind, link)) for kind in kinds}
        return harness.interleave(sides, args["rounds"], warmup=args["warmup"], clock="wall").values

    configs = [{"link": None, "rows": measure(None)}]
    if args["link_gbps"]:
        configs.append({"link": (args["link_gbps"], args["link_latency_us"]), "target": None})
    for ratio in args["sweep"]:
        # Communication = ratio x compute, where compute is the plain step without a simulated link
        # (gloo's own loopback all-to-alls included). Both ranks use rank 0's link.
        base = configs[0]["rows"]["plain"]
        compute = statistics.median(base["time_s"])
        bulk_bytes = base["bytes"][0]
        transfers = base["bulk"][0] + base["control"][0]
        wire = ratio * compute - transfers * args["link_latency_us"] * 1e-6
        if wire <= 0:
            raise SystemExit(f"latency alone exceeds {ratio} x compute; lower --link-latency-us")
        gbps = torch.tensor([bulk_bytes * 8 / wire / 1e9], dtype=torch.float64)
        torch.distributed.broadcast(gbps, 0)
        configs.append({"link": (float(gbps), args["link_latency_us"]), "target": ratio})
    for c in configs[1:]:
        c["rows"] = measure(c["link"])
    return {"configs": configs}


def main() -> None:
    ap = harness.parser(__doc__)
    add_model_args(ap, microbatches=8, micro_batch=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--link-gbps", type=float, default=None,
                    help="simulated link bandwidth, Gbit/s per direction (tests/support/simlink.py)")
    ap.add_argument("--link-latency-us", type=float, default=10.0, help="simulated link latency, microseconds")
    ap.add_argument("--sweep", default="",
                    help="comma-separated communication/compute ratios: the bandwidth for each is chosen from "
                         "the measured compute time and bytes (e.g. 0.25,0.5,1,2)")
    ap.add_argument("--no-plan", action="store_true", help="skip the serial-plans control (plain and overlap only)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = ap.parse_args()
    args = {k: getattr(a, k) for k in ("microbatches", "micro_batch", "seq", "hidden", "intermediate", "experts",
                                       "pattern", "rounds", "warmup", "threads", "device", "link_gbps",
                                       "link_latency_us", "no_plan")}
    args["sweep"] = [float(x) for x in a.sweep.split(",") if x.strip()]
    if a.device == "cuda":
        if a.link_gbps or args["sweep"]:
            raise SystemExit("the link model simulates a network on CPU; on cuda the real one is measured")
        with harness.Run("overlap", a, clock="wall") as run:
            ranks = _run_cuda(args)
        report(run, ranks, args)
        return
    from tests.train.dist_helpers import run_distributed

    with harness.Run("overlap", a, clock="wall") as run, tempfile.TemporaryDirectory() as tmp:
        ranks = run_distributed(worker, 2, Path(tmp), args, timeout=3600)
    report(run, ranks, args)


def _run_cuda(args: dict) -> list[dict]:  # pragma: no cover - needs 2 GPUs
    import os

    import torch.multiprocessing as mp

    from tests.train.dist_helpers import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_cuda_entry, args=(args, tmp), nprocs=2)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _cuda_entry(rank: int, args: dict, tmp: str) -> None:  # pragma: no cover - needs 2 GPUs
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.save(worker(rank, args), Path(tmp) / f"rank{rank}.pt")


def _summary(run: harness.Run, ranks: list[dict], i: int, base: dict | None) -> dict:
    """One configuration: median step per schedule (max over ranks), ratios, communication and hidden
    share; recorded in `run` as one case."""
    rows = [r["configs"][i]["rows"] for r in ranks]
    times = {k: rows[0][k]["time_s"] for k in rows[0]}  # max over ranks already
    med = {k: statistics.median(v) for k, v in times.items()}
    out: dict = {
        "link_gbps": ranks[0]["configs"][i]["link"][0] if ranks[0]["configs"][i]["link"] else None,
        "link_latency_us": ranks[0]["configs"][i]["link"][1] if ranks[0]["configs"][i]["link"] else None,
        "target_ratio": ranks[0]["configs"][i].get("target"),
        "median_step_ms": {k: 1e3 * v for k, v in med.items()},
        "all_step_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
        # Each round runs the three schedules back to back: the ratio within a round shares its noise.
        "paired_plain_over_overlap": statistics.median(p / o for p, o in zip(times["plain"], times["overlap"])),
        "plain_over_overlap": med["plain"] / med["overlap"],
        "plan_over_plain": med["plan"] / med["plain"] if "plan" in med else None,
    }
    link = ranks[0]["configs"][i]["link"]
    case = "no simulated link" if link is None else (
        f"link {link[0]:.3g} Gbit/s" + (f" (comm {out['target_ratio']:g} x compute)" if out["target_ratio"] else ""))
    for k, v in times.items():
        run.add(case, k, "step_s", v)
    run.ratio(case, "plain", "overlap", "step_s", name="overlap / plain speed")
    if "plan" in times:
        run.ratio(case, "plan", "plain", "step_s", name="plan / plain step time")
    comm = {}
    for k in times:
        modeled = statistics.mean(x for r in rows for x in r[k]["modeled_s"])
        blocked = statistics.mean(x for r in rows for x in r[k]["blocked_s"])
        comm[k] = {"modeled_ms_per_step": 1e3 * modeled, "blocked_ms_per_step": 1e3 * blocked,
                   "hidden_by_collectives": (1 - blocked / modeled) if modeled else None,
                   "all_to_alls_per_step": rows[0][k]["bulk"][0], "count_exchanges_per_step": rows[0][k]["control"][0],
                   "mbytes_per_step": rows[0][k]["bytes"][0] / 1e6}
        if modeled and link is not None:
            run.add(case, k, "hidden_by_collectives_share", comm[k]["hidden_by_collectives"])
        if base is not None and modeled:
            # What the link added to the step, against the same schedule without it.
            exposed = med[k] - base["median_step_s"][k]
            comm[k]["hidden_by_step_time"] = 1 - exposed / modeled
            run.add(case, k, "hidden_by_step_time_share", comm[k]["hidden_by_step_time"])
    out["comm"] = comm
    out["median_step_s"] = med
    if base is not None:
        out["comm_over_compute"] = comm["plain"]["modeled_ms_per_step"] / base["median_step_ms"]["plain"]
    return out


def report(run: harness.Run, ranks: list[dict], args: dict) -> None:
    n = len(ranks[0]["configs"])
    base = _summary(run, ranks, 0, None)
    results = [base] + [_summary(run, ranks, i, base) for i in range(1, n)]
    print(f"EP=2 on 2 {args['device']} processes (gloo on cpu / nccl on cuda), {args['microbatches']} microbatches "
          f"of {args['micro_batch']}x{args['seq']} tokens, hidden {args['hidden']}, intermediate "
          f"{args['intermediate']}, {args['experts']} experts, pattern {args['pattern'] or 'preset'}, "
          f"{args['rounds']} rounds per configuration")
    c0 = base["comm"]["plain"]
    print(f"  per step and rank: {c0['all_to_alls_per_step']} token all-to-alls, {c0['count_exchanges_per_step']} "
          f"count exchanges, {c0['mbytes_per_step']:.2f} MB over the link")
    for r in results:
        m = r["median_step_ms"]
        if r["link_gbps"] is None:
            head = "no simulated link (compute)"
        else:
            head = (f"link {r['link_gbps']:.3g} Gbit/s, {r['link_latency_us']:g} us: comm "
                    f"{r['comm']['plain']['modeled_ms_per_step']:.0f} ms/step = {r['comm_over_compute']:.2f} x compute")
        print(f"  {head}")
        plan = f"  plan {m['plan']:.0f}" if "plan" in m else ""
        print(f"    median step ms: plain {m['plain']:.0f}{plan}  overlap {m['overlap']:.0f}   "
              f"plain/overlap {r['plain_over_overlap']:.2f}x (per-round pairs {r['paired_plain_over_overlap']:.2f}x)"
              + (f"   plan/plain {r['plan_over_plain']:.2f}" if "plan" in m else ""))
        if r["link_gbps"] is not None:
            for k in ("plain", "overlap"):
                c = r["comm"][k]
                print(f"    {k:8s} hidden: {100 * c['hidden_by_step_time']:5.1f}% by step time, "
                      f"{100 * c['hidden_by_collectives']:5.1f}% by collectives (blocked "
                      f"{c['blocked_ms_per_step']:.0f} of {c['modeled_ms_per_step']:.0f} ms)")
    run.extra["results"] = results
    run.finish()


if __name__ == "__main__":
    main()
