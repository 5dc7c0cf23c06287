"""Scale simulator: what one rank of a recipe holds and which collectives one training step makes,
at the recipe's world size and EP size, in one process.

The real model of the rank (on the meta device), its bucketed gradient and parameter buffers, the
distributed optimizer, `finalize_model_grads` and the MoE dispatcher run on torch's fake process
group; every collective is recorded (tests/support/simulate.py says what is real and what is
simulated). Memory is read from the real buffers and optimizer shards; activations are the
formula of gptoss_cli/recipe/estimate/memory.py, printed with it. `--sweep` repeats the simulation at other
world sizes to show that the optimizer makes two collectives per bucket whatever W.

    python bench/scale.py --recipe gb200_bf16
    python bench/scale.py --recipe gpt_oss_20b_pretrain --ranks 0,7 --sweep 8,16,32 --json scale.json
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from tests.support.simulate import RankSimulation, simulate_rank  # noqa: E402
from gptoss_cli.model.pattern import ATTENTION, MLP, MOE  # noqa: E402
from gptoss_cli.recipe import load_recipe  # noqa: E402
from gptoss_cli.recipe.estimate.memory import DTYPE_BYTES, activation_bytes_per_token, estimate_memory, size_text  # noqa: E402
from gptoss_cli.recipe.estimate.sizes import resolve_world_size  # noqa: E402

MEMORY_ROWS = [("params", "parameters"), ("grads", "gradients (fp32 main_grad)"),
               ("optimizer.master", "optimizer: fp32 master"), ("optimizer.exp_avg", "optimizer: exp_avg (fp32)"),
               ("optimizer.exp_avg_sq", "optimizer: exp_avg_sq (fp32)")]


def memory_table(sims: list[RankSimulation], est) -> list[str]:
    head = f"{'per-rank memory':<34}" + "".join(f"{'rank ' + str(s.rank):>12}" for s in sims) + f"{'estimate':>12}"
    lines = [head]
    estimate = {"params": est.bytes_of("params"), "grads": est.bytes_of("grads")}
    opt = est.bytes_of("optimizer")
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        estimate[f"optimizer.{kind}"] = opt / 3
    for key, label in MEMORY_ROWS:
        lines.append(f"{label:<34}" + "".join(f"{size_text(s.memory[key]):>12}" for s in sims)
                     + f"{size_text(estimate[key]):>12}")
    state = [sum(s.memory.values()) for s in sims]
    lines.append(f"{'state':<34}" + "".join(f"{size_text(b):>12}" for b in state)
                 + f"{size_text(sum(estimate.values())):>12}")
    for it in est.items:
        if it.key.startswith(("activations", "transient")):
            lines.append(f"{it.label:<34}" + " " * 12 * len(sims) + f"{size_text(it.bytes):>12}")
    lines.append(f"{'peak estimate':<34}" + " " * 12 * len(sims) + f"{size_text(est.total_bytes):>12}")
    if est.capacity_bytes:
        lines.append(f"  {100 * est.fraction:.0f}% of the {est.gpu.upper()}'s {est.capacity_bytes / 1e9:.0f} GB")
    return lines


def memory_tables(sims: list[RankSimulation], cfg, arch, pattern, world: int) -> tuple[list[str], list]:
    """One memory table per pipeline rank among `sims` (one table without PP), each against that rank's
    estimate; the lines and the estimates."""
    by_stage: dict[int, list[RankSimulation]] = {}
    for s in sims:
        by_stage.setdefault(s.pp_rank, []).append(s)
    lines, estimates = [], []
    for pp_rank, group in by_stage.items():
        est = estimate_memory(cfg, arch, pattern, world, pipeline_rank=pp_rank if group[0].pp_size > 1 else None)
        estimates.append(est)
        if group[0].pp_size > 1:
            lines.append(f"pipeline rank {pp_rank} of {group[0].pp_size} ({est.stages[pp_rank]['stages']}):")
        lines += memory_table(group, est)
    return lines, estimates


def formula_lines(cfg, arch) -> list[str]:
    b = DTYPE_BYTES[cfg.precision.params_dtype]
    per = activation_bytes_per_token(arch, b, aux_loss=cfg.moe.aux_loss_coeff > 0)
    h, i, k, v = arch.hidden_size, arch.intermediate_size, arch.num_experts_per_tok, arch.vocab_size
    return [
        f"activations per token (b = {b} B params dtype, h = {h}, I = {i}, k = {k}, V = {v}, "
        f"{arch.num_attention_heads} q / {arch.num_key_value_heads} kv heads of {arch.head_dim}; "
        "gptoss_cli/recipe/estimate/memory.py):",
        f"  attention layer  8h + b*h + b*(2*nh*d' + c*2*kv*d') + 4*nh + b*nh*d (c <= 2: sliding blocks) = {per[ATTENTION]:,.0f} B",
        f"  MoE layer        8h + b*h + k*(b*(4h + 3I) + 16 + b) + 8k + b*k (+ 4E aux) = {per[MOE]:,.0f} B",
        f"  dense MLP layer  8h + b*h + 3*b*I = {per[MLP]:,.0f} B",
        f"  head             8h + b*h = {per['head']:,.0f} B;  logits and loss  (b + 12)*V = {per['logits']:,.0f} B",
    ]


def collective_rows(sim: RankSimulation) -> list[dict]:
    rows: dict[tuple, dict] = {}
    for phase, c, times in sim.collectives():
        r = rows.setdefault((phase, c.op, c.group, c.group_size), {
            "phase": phase, "op": c.op, "group": c.group, "group_size": c.group_size, "calls_per_step": 0,
            "min_bytes": c.payload_bytes, "max_bytes": c.payload_bytes, "sent_bytes_per_step": 0.0})
        r["calls_per_step"] += times
        r["min_bytes"] = min(r["min_bytes"], c.payload_bytes)
        r["max_bytes"] = max(r["max_bytes"], c.payload_bytes)
        r["sent_bytes_per_step"] += c.wire_bytes * times
    return list(rows.values())


def collective_table(sim: RankSimulation) -> list[str]:
    lines = [f"{'phase':<44}{'op':<16}{'group':<16}{'calls/step':>11}{'bytes/call':>22}{'sent/step':>12}"]
    for r in collective_rows(sim):
        size = (size_text(r["min_bytes"]) if r["min_bytes"] == r["max_bytes"]
                else f"{size_text(r['min_bytes'])}-{size_text(r['max_bytes'])}")
        lines.append(f"{r['phase']:<44}{r['op']:<16}{r['group'] + ' (' + str(r['group_size']) + ')':<16}"
                     f"{r['calls_per_step']:>11,}{size:>22}{size_text(r['sent_bytes_per_step']):>12}")
    lines.append(f"{'total':<76}{sim.count():>11,}{'':>22}{size_text(sim.wire_bytes()):>12}")
    return lines


def optimizer_collectives(sim: RankSimulation) -> dict:
    rs = sim.count("reduce_scatter", "finalize_model_grads")
    ag = sim.count("all_gather", "optimizer step")
    ar = sim.count("all_reduce", "optimizer step")
    sharded = [g for g, size in (("dense", sim.world_size // sim.pp_size), ("expert", sim.expert_dp_size)) if size > 1]
    buckets = sum(sim.buckets[g] for g in sharded)
    return {"world_size": sim.world_size, "buckets": dict(sim.buckets), "reduced_buckets": buckets,
            "reduce_scatter": rs, "all_gather": ag, "all_reduce": ar,
            "per_bucket": (rs + ag) / buckets if buckets else 0.0}


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--recipe", default="gb200_bf16", help="recipe name or YAML path")
    p.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    p.add_argument("--world-size", type=int, default=None, help="default: the recipe's")
    p.add_argument("--ranks", default=None, help="ranks to simulate, e.g. 0,63 (default: first and last)")
    p.add_argument("--sweep", default=None, help="also simulate rank 0 at these world sizes, e.g. 64,128,256")
    args = p.parse_args()
    run = harness.Run("scale", args).__enter__()  # a simulation: no clock

    recipe = load_recipe(args.recipe, args.overrides)
    cfg, arch = recipe.config, recipe.arch
    world, _ = resolve_world_size(cfg, args.world_size)
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else sorted({0, world - 1})
    sims = [simulate_rank(cfg, arch, recipe.pattern, world, r) for r in ranks]
    tables, estimates = memory_tables(sims, cfg, arch, recipe.pattern, world)
    est = estimates[0]
    s0 = sims[0]
    bucket = cfg.optimizer.bucket_size or "Megatron's default max(40M, 1M x DP)"
    name = cfg.name or args.recipe
    pp = f"PP {s0.pp_size} x " if s0.pp_size > 1 else ""
    print(f"{name}: {cfg.model.preset or 'model'}, world {world} = {pp}expert-DP {s0.expert_dp_size} x EP {s0.ep_size}, "
          f"{cfg.precision.params_dtype}, {'distributed' if cfg.optimizer.use_distributed_optimizer else 'replicated'} "
          f"optimizer, buckets of {bucket} elements ({s0.buckets['dense']} dense, {s0.buckets['expert']} expert)")
    print(f"simulated rank(s) {', '.join(map(str, ranks))} on torch's fake process group: meta tensors, the real "
          "buffers, optimizer, finaliser and dispatcher; balanced routing\n")
    for line in tables:
        print(line)
    print()
    for line in formula_lines(cfg, arch):
        print(line)
    print(f"\ncollectives per step, rank {s0.rank} ({s0.microbatches} microbatches of {s0.tokens_per_microbatch:,} "
          f"tokens, {s0.moe_layers} MoE layers; sent = bytes this rank puts on the wire, ring algorithms)")
    for line in collective_table(s0):
        print(line)
    opt = optimizer_collectives(s0)
    print(f"\noptimizer: {opt['reduce_scatter']} reduce-scatters + {opt['all_gather']} all-gathers for "
          f"{opt['reduced_buckets']} buckets reduced over a group of more than one rank ({opt['per_bucket']:g} per "
          f"bucket) + {opt['all_reduce']} all-reduce (gradient norm)")
    sweep = []
    if args.sweep:
        print(f"\n{'world':>6}{'buckets':>10}{'reduce-scatter':>16}{'all-gather':>12}{'all-reduce':>12}{'per bucket':>12}")
        for w in (int(x) for x in args.sweep.split(",")):
            o = optimizer_collectives(simulate_rank(cfg, arch, recipe.pattern, w, 0))
            sweep.append(o)
            print(f"{w:>6}{o['reduced_buckets']:>10}{o['reduce_scatter']:>16}{o['all_gather']:>12}{o['all_reduce']:>12}"
                  f"{o['per_bucket']:>12g}")
    for s, e in zip(sims, estimates):
        case = f"{name}, W={world}, rank {s.rank}"
        for key, value in s.memory.items():
            run.add(case, "simulated", f"{key}_gb", value / 1e9)
        run.add(case, "simulated", "state_gb", sum(s.memory.values()) / 1e9)
        if e is not None:
            run.add(case, "estimate", "peak_gb", e.total_bytes / 1e9)
    case = f"{name}, W={world}, rank {s0.rank}, one step"
    run.add(case, "simulated", "collectives", s0.count())
    run.add(case, "simulated", "sent_gb", s0.wire_bytes() / 1e9)
    run.add(case, "simulated", "optimizer_collectives_per_bucket", opt["per_bucket"])
    for o in sweep:
        run.add(f"{name}, W={o['world_size']}, rank 0, one step", "simulated", "optimizer_collectives_per_bucket",
                o["per_bucket"])
    run.extra.update({
        "recipe": name, "world_size": world, "ranks": [
            {"rank": s.rank, "memory": s.memory, "buckets": s.buckets} for s in sims],
        "estimate": est.to_dict() if est else None,
        "estimates": [e.to_dict() if e else None for e in estimates], "collectives": collective_rows(s0),
        "collectives_per_step": s0.count(), "sent_bytes_per_step": s0.wire_bytes(),
        "optimizer": opt, "sweep": sweep})
    run.finish()


if __name__ == "__main__":
    sys.exit(main())
