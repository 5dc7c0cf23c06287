"""Benchmark pipeline parallelism (issue 38): the measured bubble of each schedule against its theory, and
the EP overlap's hidden share under DualPipeV against no pipelining, on the simulated link.

Part 1, the bubble: PP=2 on 2 gloo processes (one per core; EP=1, the widened tiny GPT-OSS in fp32, mock
data), each schedule in turn, `rounds` timed training steps (forward, backward, finalize; no optimizer).
Every stage action (torch's forward, backward, backward-for-weights of a chunk) is timed on its rank:
  measured bubble = 1 - busy / step time, on the rank that idles most (both ranks' figures printed);
  theory (closed form) = schedule/pipeline/layout.py's `bubble_fraction` at the measured per-microbatch f, b, w;
  theory (the schedule's own order) = torch's action lists of the schedule replayed with the measured
      action times and free communication (an event simulation: F(s, m) after F(s-1, m), the backward
      of (s, m) after that of (s+1, m), W after its I), i.e. what the order itself costs.
The activations go between the stages over gloo's loopback (nearly free here).

Part 2, the overlap: 4 gloo processes, EP=2, every MoE all-to-all carried by the simulated link
(tests/support/simlink.py) at a bandwidth chosen so that the link time is `--ratio` x the compute of the
no-pipelining step; hidden share = 1 - (time blocked on the link) / (the link's modelled time):
  no pipelining      DP=2 x EP=2, combined 1F1B with overlap and delayed wgrad (issue 6's schedule)
  dualpipev          PP=2 x EP=2, DualPipeV, its overlapped actions run in sequence (the control)
  dualpipev+overlap  PP=2 x EP=2, DualPipeV, OVERLAP_F_B interleaving two microbatches' plans
                     (gptoss_cli/schedule/pipeline/plan_stage.py), delayed wgrad
On 2 cores 4 processes share them: compute is slower than it would be alone and gloo's copies
compete with it; the figures are what this machine measures (bench/README.md).

    python bench/pipeline.py --rounds 5
    python bench/pipeline.py --rounds 3 --ratio 1.0 --json pipeline.json
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402

SCHEDULES = {"1f1b": (None, "Et*2|t*2L"), "interleaved_1f1b": (2, "Et|t|t|tL"),
             "interleaved_zero_bubble": (None, "Et*2|t*2L"), "zbv_zero_bubble": (2, "Et|t|t|tL"),
             "dualpipev": (2, "Et|t|t|tL")}


def setup(args: dict, state: Any, **fields: Any):
    """The widened tiny model (4 blocks) at `state`, wrapped and with its optimizer, and its mock data."""
    from gptoss_cli.model.config import preset
    from gptoss_cli.model.pattern import default_pattern
    from gptoss_cli.recipe.schema import RecipeConfig
    from gptoss_cli.train.data import MockSource
    from gptoss_cli.train.provider import HybridModelProvider, ModelRuntimeConfig
    from gptoss_cli.train.setup import setup_model_and_optimizer

    arch = preset("tiny").replace(hidden_size=args["hidden"], intermediate_size=args["intermediate"],
                                  num_local_experts=args["experts"], num_experts_per_tok=2, num_hidden_layers=4)
    cfg = RecipeConfig()
    cfg.precision.params_dtype, cfg.moe.aux_loss_coeff = "fp32", 0.0
    for dotted, value in fields.items():
        section, name = dotted.split(".")
        setattr(getattr(cfg, section), name, value)
    runtime = ModelRuntimeConfig.from_recipe(cfg, arch, default_pattern(arch))
    built = setup_model_and_optimizer(HybridModelProvider(runtime, seed=1), state, cfg.optimizer, cfg.training.lr)
    built.model.train()
    return built, MockSource(arch.vocab_size, args["seq"], seed=3)


def timed_step(model: Any, config: Any, source: Any, state: Any, args: dict, schedule_fn: Any) -> float:
    """One step over the same global batch (position 0 of the data), max over ranks."""
    from gptoss_cli.train.data import DataLoaderState
    from gptoss_cli.train.objective import forward_step

    mb, n = args["micro_batch"], args["microbatches"]
    data = DataLoaderState(source, global_batch_size=mb * n * state.data_parallel_size, micro_batch_size=mb,
                           dp_rank=state.data_parallel_rank, dp_size=state.data_parallel_size, device=state.device)
    model.zero_grad_buffer()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    schedule_fn(forward_step_func=forward_step, data_iterator=data.step_iterator(), model=model, num_microbatches=n)
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    torch.distributed.all_reduce(dt, op=torch.distributed.ReduceOp.MAX)
    return float(dt)


class ActionClock:
    """Times every forward / backward / weight action of a runtime's stages on this rank."""

    KINDS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}

    def __init__(self, runtime: Any):
        self.times: dict[tuple[int, str], list[float]] = {}
        self.busy = 0.0
        for stage in runtime.stages:
            for method, kind in self.KINDS.items():
                self._wrap(stage, method, kind)
        # the loss (LM head) runs between the last stage's forward and its backward: counted with its forward
        real_loss = runtime.schedule._loss_fn
        last = runtime.layout.num_stages - 1

        def loss(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real_loss(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                self.times.setdefault((last, "L"), []).append(dt)
                self.busy += dt

        runtime.schedule._loss_fn = loss

    def _wrap(self, stage: Any, method: str, kind: str) -> None:
        real = getattr(stage, method)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                full = kind == "B" and kw.get("full_backward", True)
                key = (stage.stage_index, kind if kind != "B" else ("B" if full else "I"))
                self.times.setdefault(key, []).append(dt)
                self.busy += dt

        setattr(stage, method, timed)

    def reset(self) -> None:
        self.times, self.busy = {}, 0.0


def replay(order: dict[int, list], durations: dict[tuple[int, str], float], num_stages: int) -> dict[int, float]:
    """Each rank's idle share when torch's action lists run with `durations` and free communication."""
    done: dict[tuple[int, str, int], float] = {}
    clock = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    compute = {"F", "B", "I", "W", "OVERLAP_F_B"}  # not REDUCE_GRAD and the like
    queues = {r: [a for a in acts if a is not None and a.computation_type.value in compute] for r, acts in order.items()}

    def leaves(action: Any) -> list:
        return list(action.sub_actions) if getattr(action, "sub_actions", None) else [action]

    def ready(a: Any) -> float | None:
        kind, s, m = a.computation_type.value, a.stage_index, a.microbatch_index
        if kind == "F":
            need = [] if s == 0 else [(s - 1, "F", m)]
        elif kind in ("B", "I"):
            need = [(s, "F", m)] if s == num_stages - 1 else [(s + 1, "B", m)]
        else:  # W
            need = [(s, "I", m)]
        if any(k not in done for k in need):
            return None
        return max((done[k] for k in need), default=0.0)

    while any(queues.values()):
        progressed = False
        for r, q in queues.items():
            while q:
                parts = leaves(q[0])
                starts = [ready(a) for a in parts]
                if any(t is None for t in starts):
                    break
                t = max([clock[r], *starts])
                for a in parts:
                    kind = a.computation_type.value
                    cost = durations.get((a.stage_index, kind))
                    if cost is None:  # a whole backward where only its halves were timed, or the reverse
                        cost = (durations.get((a.stage_index, "I"), 0.0) + durations.get((a.stage_index, "W"), 0.0)
                                if kind == "B" else durations.get((a.stage_index, "B"), 0.0) if kind == "I" else 0.0)
                    t += cost
                    for key in ([(a.stage_index, "B", a.microbatch_index), (a.stage_index, "I", a.microbatch_index)]
                                if kind in ("B", "I") else [(a.stage_index, kind, a.microbatch_index)]):
                        done[key] = t
                    busy[r] += cost
                clock[r] = t
                q.pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError(f"the action lists deadlock at {[(r, str(q[0])) for r, q in queues.items() if q]}")
    end = max(clock.values())
    return {r: 1 - busy[r] / end for r in order}


def one_f_one_b_order(pp: int, n: int) -> dict[int, list[str]]:
    """The action order torch's Schedule1F1B executes (its `_step_microbatches`: min(n, PP - rank)
    warm-up forwards, then one backward and one forward, then the remaining backwards). Its
    `_get_pipeline_order` (the visualiser's IR) omits F0 on the last rank, so it is not used."""
    order = {}
    for rank in range(pp):
        warm = min(n, pp - rank)
        acts, f, b = [f"{rank}F{i}" for i in range(warm)], warm, 0
        while b < n:
            acts.append(f"{rank}B{b}")
            b += 1
            if f < n:
                acts.append(f"{rank}F{f}")
                f += 1
        order[rank] = acts
    return order


def bubble_worker(rank: int, args: dict) -> dict:
    from gptoss_cli.parallel.state import init_parallel
    from gptoss_cli.schedule.pipeline.schedule import forward_backward_pipelining

    torch.set_num_threads(1)
    out = {}
    for name, (vpp, layout) in SCHEDULES.items():
        state = init_parallel(1, "cpu", pp_size=2)
        built, source = setup(args, state, **{
            "parallelism.pipeline_model_parallel_size": 2, "parallelism.virtual_pipeline_model_parallel_size": vpp,
            "parallelism.pipeline_schedule": name, "parallelism.pipeline_model_parallel_layout": layout})
        model, config = built.model, built.config
        timed_step(model, config, source, state, args, forward_backward_pipelining)  # builds the runtime, warms up
        runtime = model.module.pipeline_runtime
        clock = ActionClock(runtime)
        acts: dict = {}

        def step() -> dict:
            seconds = timed_step(model, config, source, state, args, forward_backward_pipelining)
            for k, v in clock.times.items():
                acts.setdefault(k, []).extend(v)
            return {"time_s": seconds, "busy_s": clock.busy}

        timed = harness.interleave({name: step}, args["rounds"], warmup=0, clock="wall", before=clock.reset)
        steps, busy = timed[name]["time_s"], timed[name]["busy_s"]
        med = {k: statistics.median(v) for k, v in acts.items()}
        order = one_f_one_b_order(2, args["microbatches"]) if name == "1f1b" else runtime.schedule.pipeline_order
        out[name] = {"step_s": steps, "busy_s": busy, "actions": {f"{s}{k}": v for (s, k), v in med.items()},
                     "order": {r: [str(a) for a in acts_ if a is not None] for r, acts_ in order.items()},
                     "pp_rank": state.pp_rank, "num_stages": runtime.layout.num_stages, "vpp": runtime.layout.vpp}
    return out


def overlap_worker(rank: int, args: dict) -> dict:
    from tests.support.simlink import LinkModel, use_link
    from gptoss_cli.parallel.state import init_parallel
    from gptoss_cli.schedule.pipeline.schedule import forward_backward_pipelining
    from gptoss_cli.schedule.combined_1f1b import forward_backward_combined_1f1b

    torch.set_num_threads(1)
    base = {"parallelism.expert_model_parallel_size": 2, "precision.params_dtype": "fp32"}
    pipe = {**base, "parallelism.pipeline_model_parallel_size": 2, "parallelism.virtual_pipeline_model_parallel_size": 2,
            "parallelism.pipeline_schedule": "dualpipev", "parallelism.pipeline_model_parallel_layout": "Et|t|t|tL"}
    over = {"overlap.overlap_moe_expert_parallel_comm": True, "overlap.delay_wgrad_compute": True}
    runs = {"no pipelining": (1, {**base, **over}, forward_backward_combined_1f1b),
            "dualpipev": (2, pipe, forward_backward_pipelining),
            "dualpipev+overlap": (2, {**pipe, **over}, forward_backward_pipelining)}
    built_runs = {}
    for name, (pp, fields, fn) in runs.items():
        state = init_parallel(2, "cpu", pp_size=pp)
        built, source = setup(args, state, **fields)
        timed_step(built.model, built.config, source, state, args, fn)  # warm-up (builds the pipeline runtime)
        built_runs[name] = (state, built, source, fn)
    # the link's bandwidth: its time = ratio x the compute of the no-pipelining step
    state, built, source, fn = built_runs["no pipelining"]
    probe = LinkModel(float("inf"), 0.0)
    with use_link(built.model, probe):
        compute = timed_step(built.model, built.config, source, state, args, fn)
    wire = args["ratio"] * compute - probe.transfers * args["latency_us"] * 1e-6
    gbps = torch.tensor([probe.bytes_moved * 8 / max(wire, 1e-9) / 1e9], dtype=torch.float64)
    torch.distributed.broadcast(gbps, 0)
    out: dict[str, Any] = {"gbps": float(gbps), "compute_s": compute}

    def side(state, built, source, fn):
        def step() -> dict:
            link = LinkModel(float(gbps), args["latency_us"])
            with use_link(built.model, link):
                seconds = timed_step(built.model, built.config, source, state, args, fn)
            return {"time_s": seconds, "modeled_s": link.modeled_s, "blocked_s": link.blocked_s}
        return step

    # the three runs in interleaved rounds, the order rotating (every rank runs the same order)
    timed = harness.interleave({name: side(*run) for name, run in built_runs.items()}, args["rounds"], warmup=0,
                               clock="wall")
    for name in built_runs:
        v = timed[name]
        out[name] = [{"step_s": s, "modeled_s": m, "blocked_s": b}
                     for s, m, b in zip(v["time_s"], v["modeled_s"], v["blocked_s"])]
    return out


def bubble_report(ranks: list[dict], microbatches: int) -> list[dict]:
    from gptoss_cli.schedule.pipeline.layout import SPLIT_BACKWARD, bubble_fraction
    from torch.distributed.pipelining.schedules import _Action

    results = []
    for name in SCHEDULES:
        per_rank = [r[name] for r in ranks]
        step = statistics.median(per_rank[0]["step_s"])
        measured = {r["pp_rank"]: 1 - statistics.median(r["busy_s"]) / step for r in per_rank}
        durations = {}
        for r in per_rank:
            for key, v in r["actions"].items():
                durations[(int(key[:-1]), key[-1])] = v
        last = per_rank[0]["num_stages"] - 1
        durations[(last, "F")] = durations.get((last, "F"), 0.0) + durations.pop((last, "L"), 0.0)
        order = {int(k): [_Action.from_str(a) for a in v] for k, v in per_rank[0]["order"].items()}
        simulated = replay(order, durations, per_rank[0]["num_stages"]) if order else {}
        f = statistics.mean(v for (s, k), v in durations.items() if k == "F") * per_rank[0]["vpp"]
        full = [v for (s, k), v in durations.items() if k == "B"]
        split = name in SPLIT_BACKWARD and any(k == "I" for (_, k) in durations)
        b = statistics.mean(v for (s, k), v in durations.items() if k == ("I" if split else "B")) * per_rank[0]["vpp"]
        w = statistics.mean(v for (s, k), v in durations.items() if k == "W") * per_rank[0]["vpp"] if split else 0.0
        if full and split:  # some of a split schedule's backwards are whole
            b = min(b, statistics.mean(full) * per_rank[0]["vpp"])
        results.append({"schedule": name, "median_step_ms": 1e3 * step, "step_s": per_rank[0]["step_s"],
                        "measured_bubble": measured,
                        "theory_closed_form": bubble_fraction(name, 2, per_rank[0]["vpp"], microbatches, f, b, w),
                        "theory_replayed": simulated, "f_b_w_ms": [1e3 * f, 1e3 * b, 1e3 * w]})
    return results


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ratio", type=float, default=1.0, help="link time / no-pipelining compute (part 2)")
    ap.add_argument("--latency-us", type=float, default=10.0)
    ap.add_argument("--skip", choices=["bubble", "overlap"], default=None)
    a = ap.parse_args()
    args = {k: getattr(a, k) for k in ("microbatches", "micro_batch", "seq", "hidden", "intermediate", "experts",
                                       "rounds", "ratio", "latency_us")}
    from tests.train.dist_helpers import run_distributed

    result: dict[str, Any] = {}
    run = harness.Run("pipeline", a, clock="wall").__enter__()
    with tempfile.TemporaryDirectory() as tmp:
        if a.skip != "bubble":
            result["bubble"] = bubble_report(run_distributed(bubble_worker, 2, Path(tmp) / "b", args, timeout=3600),
                                             args["microbatches"])
            print(f"bubble: PP=2, {args['microbatches']} microbatches of {args['micro_batch']}x{args['seq']} tokens, "
                  f"hidden {args['hidden']}, {args['rounds']} rounds")
            for r in result["bubble"]:
                meas = ", ".join(f"rank {k} {100 * v:.1f}%" for k, v in sorted(r["measured_bubble"].items()))
                sim = ", ".join(f"rank {k} {100 * v:.1f}%" for k, v in sorted(r["theory_replayed"].items()))
                print(f"  {r['schedule']:24s} step {r['median_step_ms']:7.1f} ms  measured {meas}  |  theory: closed "
                      f"form {100 * r['theory_closed_form']:.1f}%, torch's order replayed {sim}  (f, b, w ms "
                      + ", ".join(f"{x:.1f}" for x in r["f_b_w_ms"]) + ")")
                run.add("PP=2 bubble", r["schedule"], "step_s", r["step_s"])
                for k, v in sorted(r["measured_bubble"].items()):
                    run.add("PP=2 bubble", r["schedule"], f"bubble_rank{k}_share", v)
                run.add("PP=2 bubble", r["schedule"], "closed_form_bubble_share", r["theory_closed_form"])
                for k, v in sorted(r["theory_replayed"].items()):
                    run.add("PP=2 bubble", r["schedule"], f"replayed_bubble_rank{k}_share", v)
        if a.skip != "overlap":
            ranks = run_distributed(overlap_worker, 4, Path(tmp) / "o", args, timeout=3600,
                                    preload=("gptoss_cli.train.loop", "gptoss_cli.schedule.pipeline.schedule"))
            result["overlap"] = overlap_report(ranks)
            r0 = ranks[0]
            print(f"overlap: EP=2 on the simulated link, {r0['gbps']:.3g} Gbit/s (= {args['ratio']:g} x the "
                  f"no-pipelining compute of {1e3 * r0['compute_s']:.0f} ms), {args['rounds']} rounds")
            case = f"EP=2 overlap, link = {args['ratio']:g} x compute"
            for name, r in result["overlap"].items():
                print(f"  {name:20s} step {r['median_step_ms']:7.1f} ms  link {r['modeled_ms']:6.1f} ms, hidden "
                      f"{100 * r['hidden']:5.1f}% (median over ranks and rounds)")
                run.add(case, name, "step_s", [row["step_s"] for row in ranks[0][name]])
                run.add(case, name, "hidden_share", r["hidden"])
            run.ratio(case, "dualpipev", "dualpipev+overlap", "step_s", name="dualpipev+overlap / dualpipev speed")
    run.extra.update(result)
    run.finish()


def overlap_report(ranks: list[dict]) -> dict[str, dict]:
    out = {}
    for name in ("no pipelining", "dualpipev", "dualpipev+overlap"):
        rows = [row for r in ranks for row in r[name]]
        hidden = [1 - row["blocked_s"] / row["modeled_s"] for row in rows if row["modeled_s"] > 0]
        out[name] = {"median_step_ms": 1e3 * statistics.median(row["step_s"] for row in ranks[0][name]),
                     "modeled_ms": 1e3 * statistics.median(row["modeled_s"] for row in rows),
                     "hidden": statistics.median(hidden) if hidden else 0.0}
    return out


if __name__ == "__main__":
    main()
