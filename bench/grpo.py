"""Benchmark a GRPO step against TRL's GRPOTrainer: rollout and training time, the kernel's share, the decode.

Part 1, the step: `tiny_cpu_grpo` (1 process, gptoss rollouts, builtin:arithmetic prompts, even_tokens,
4 prompts x 4 completions of 16 tokens per step) run by `gptoss train`'s worker for `--steps` steps on
the policy of bench/trl_peer.py (transformers' GptOssForCausalLM with the tests' random weights, saved
as an HF folder, at `--preset` and `--vocab`), then TRL's GRPOTrainer on the same folder, prompts and
settings (bench/trl_peer.py). Per optimizer step after the first (warm-up), on this process's CPU
clock (one thread): the step's time, the rollout's (sampling, rewards, old/reference log-probs) and
the rest (training), completion tokens per second of the step, and the kernel's account of the step
(harness counters: user and system seconds, minor page faults). The headline: gptoss over TRL in
completion tokens per second, per step pair (median, min-max). Before the runs, one fixed rollout
(random completions, fixed advantages, old log-probabilities the current ones +-0.35 so the clip is
active) goes through both losses at the initial weights: the step-1 losses must agree to 1e-4
(relative; fp32 sums over the vocabulary in another order are far below it) or the bench stops.
`--before` adds a gptoss run with the LM head's buffers fresh per chunk and the heap handed back
after every step (GPTOSS_LM_HEAD_BUFFERS=fresh, GPTOSS_HEAP_RELEASE_GROWTH=0: as before issue 55).

Part 2, the decode: the same rows of completions sampled by the rollout engine (`rl/sampling.py`
`sample_completions`, which also returns each token's log-probability) and by `generate`'s loop
(`generate/decode.py` `generate_ids`, the same temperature-1 sampling) on one model and the same prompts,
no stop token (every row decodes `--new` tokens), in rounds whose order rotates; CPU time at one thread.
The headline is rollout tokens/s over generate's, the median of the per-round ratios with min-max.

    python bench/grpo.py --preset tiny --steps 6 --rounds 5
    python bench/grpo.py --vocab 201088 --steps 4 --before --no-decode     # the real vocabulary
    python bench/grpo.py --preset medium --steps 4 --rounds 3 --json grpo.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench import harness  # noqa: E402
from bench.peers import bench_arch  # noqa: E402
from gptoss_cli.resources import peak_rss_bytes  # noqa: E402

import torch  # noqa: E402


STEP_METRICS = ("time_s", "user_s", "system_s", "minor_faults")


def grpo_step_times(arch, steps: int, folder: Path, policy: Path, overrides: list[str],
                    env: dict[str, str] | None = None) -> dict:
    """Run tiny_cpu_grpo's settings on the policy folder for `steps` steps; per step (after the first): the
    harness's counters of the whole step and the rollout's CPU time, completion tokens, reward."""
    import os

    from gptoss_cli.model.pattern import default_pattern
    from gptoss_cli.recipe import load_recipe
    from gptoss_cli.rl.rollouts import RolloutData
    from gptoss_cli.run.worker import run_worker
    from gptoss_cli.train.job import TrainJob
    from gptoss_cli.train.progress import StepDone

    recipe = load_recipe("tiny_cpu_grpo", [f"training.train_iters={steps}", f"checkpoint.pretrained={policy}",
                                           "checkpoint.dir=null", f"rl.tokenizer={policy / 'tokenizer.json'}",
                                           "moe.aux_loss_coeff=0", f"logging.run_dir={folder / 'run'}", *overrides])
    job = TrainJob(config=recipe.config, arch=arch, pattern=default_pattern(arch), name="bench",
                   run_dir=str(folder / "run"))
    calls: list[dict] = []
    rollouts: list[float] = []
    mark = [harness.cpu_clock(), harness.usage()]

    def progress(event) -> None:  # one StepDone per step (tiny_cpu logs every step)
        if isinstance(event, StepDone):
            calls.append({"time_s": harness.cpu_clock() - mark[0], **harness.usage_since(mark[1])})
            mark[:] = [harness.cpu_clock(), harness.usage()]

    sample = RolloutData.sample

    def timed_sample(self, *a, **k):
        out, metrics = harness.measure(lambda: sample(self, *a, **k))
        rollouts.append(metrics["time_s"])
        return out

    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    RolloutData.sample = timed_sample
    try:
        run_worker(job, progress=progress)
    finally:
        RolloutData.sample = sample
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("rank", 0) == 0]
    out = {k: [c[k] for c in calls] for k in STEP_METRICS}
    out["rollout_s"] = rollouts[:len(calls)]
    out["completion_tokens"] = [r["rollout_tokens"] for r in rows]
    out["reward"] = [r["reward_mean"] for r in rows]
    return out


def per_step(raw: dict[str, list[float]]) -> dict[str, list[float]]:
    """Steps after the first: the counters, the training part, completion tokens per second."""
    keep = {k: v[1:] for k, v in raw.items()}
    keep["train_s"] = [t - r for t, r in zip(keep["time_s"], keep["rollout_s"])]
    keep["completion_tokens_per_s"] = [n / t for n, t in zip(keep["completion_tokens"], keep["time_s"])]
    keep["system_share"] = [s / u for s, u in zip(keep["system_s"], keep["user_s"])]
    return keep


def decode_ratio(run: harness.Run, arch, rows: int, prompt: int, new: int, rounds: int) -> dict:
    """Rollout sampling against generate's sampling loop: tokens/s of each, per round, alternating."""
    from gptoss_cli.generate.decode import Sampling, generate_ids
    from gptoss_cli.model.hybrid import HybridModel
    from gptoss_cli.rl.sampling import sample_completions

    model = HybridModel(arch).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, arch.vocab_size - 3, (prompt,), generator=g).tolist() for _ in range(rows)]
    sampling = Sampling(temperature=1.0, top_p=1.0, seed=0)

    def rollout() -> dict:
        out = sample_completions(model, prompts, max_new_tokens=new, stop_ids=(), sampling=sampling,
                                 generator=torch.Generator().manual_seed(0))
        return {"tokens": sum(len(ids) for ids, _, _ in out)}

    def generate() -> dict:
        return {"tokens": sum(len(gen.output_ids) for gen in generate_ids(model, prompts, max_new_tokens=new,
                                                                          sampling=sampling))}

    with torch.inference_mode():
        timed = harness.interleave({"rollout": rollout, "generate": generate}, rounds, clock="cpu")
    case = f"decode {rows} x ({prompt} + {new})"
    for name in ("rollout", "generate"):
        run.add(case, name, "tokens_per_s", [n / s for n, s in zip(timed[name]["tokens"], timed[name]["time_s"])])
    ratio = run.ratio(case, "rollout", "generate", "tokens_per_s")
    med = {name: run.cases[case]["settings"][name]["tokens_per_s"] for name in ("rollout", "generate")}
    return {"rows": rows, "prompt": prompt, "new": new,
            "rollout_tokens_per_s": (med["rollout"]["median"], med["rollout"]["min"], med["rollout"]["max"]),
            "generate_tokens_per_s": (med["generate"]["median"], med["generate"]["min"], med["generate"]["max"]),
            "ratio_text": harness.ratio_text(ratio["values"])}


def run_steps(run: harness.Run, args, arch, tmp: Path) -> dict:
    """Part 1: the step-1 check, gptoss's steps (and --before's), TRL's steps; recorded as case `step`."""
    from bench import trl_peer

    policy = trl_peer.write_policy(arch, tmp / "policy")
    prompts = trl_peer.prompt_ids(policy)
    trl = None if args.no_trl else trl_peer.trl_trainer(policy, prompts, args.steps, tmp / "trl")
    check = trl_peer.step1_check(trl, policy, arch, prompts) if trl is not None else None
    if check is not None and check["relative_difference"] > 1e-4:
        raise SystemExit(f"bench: step-1 GRPO losses differ: gptoss {check['gptoss_loss']:.7g}, TRL "
                         f"{check['trl_loss']:.7g}: the two sides do not compute the same loss")
    sides = {"gptoss": grpo_step_times(arch, args.steps, tmp / "gptoss", policy, args.overrides)}
    if args.before:
        sides["gptoss, before issue 55"] = grpo_step_times(
            arch, args.steps, tmp / "before", policy, args.overrides,
            env={"GPTOSS_LM_HEAD_BUFFERS": "fresh", "GPTOSS_HEAP_RELEASE_GROWTH": "0"})
    if trl is not None:
        sides["TRL GRPOTrainer"] = trl_peer.trl_step_times(trl)
    for name, raw in sides.items():
        for metric, values in per_step(raw).items():
            run.add("step", name, metric, values)
    if trl is not None:
        run.ratio("step", "gptoss", "TRL GRPOTrainer", "completion_tokens_per_s", name="gptoss / TRL, tokens/s")
    return {"check": check, "sides": list(sides)}


def print_steps(run: harness.Run, result: dict) -> None:
    settings = run.cases["step"]["settings"]
    check = result["check"]
    if check is not None:
        print(f"step-1 loss on one fixed rollout: gptoss {check['gptoss_loss']:.7g}, TRL {check['trl_loss']:.7g} "
              f"(relative difference {check['relative_difference']:.1e})")
    print(f"per GRPO step ({STEP_ROWS_TEXT}), median [min, max] over the steps after the first, CPU time:")
    print(f"  {'side':<26} {'step s':>8} {'rollout s':>10} {'train s':>8} {'tokens/s':>9} {'user s':>7} "
          f"{'system s':>9} {'sys/user':>9} {'minor faults':>13}")
    for name in result["sides"]:
        m = {k: v["median"] for k, v in settings[name].items()}
        print(f"  {name:<26} {m['time_s']:>8.3f} {m['rollout_s']:>10.3f} {m['train_s']:>8.3f} "
              f"{m['completion_tokens_per_s']:>9.1f} {m['user_s']:>7.3f} {m['system_s']:>9.3f} "
              f"{100 * m['system_share']:>8.1f}% {m['minor_faults']:>13.0f}")
    ratio = run.cases["step"]["ratios"].get("gptoss / TRL, tokens/s")
    if ratio:
        print(f"gptoss / TRL GRPOTrainer, completion tokens per second of a step: "
              f"{harness.ratio_text(ratio['values'])}")


STEP_ROWS_TEXT = "4 prompts x 4 completions of up to 16 tokens"


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--preset", default="tiny", help="tiny, medium or wide (bench/peers.py)")
    p.add_argument("--vocab", type=int, default=None, help="the preset at this vocabulary (201088: GPT-OSS's)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt", type=int, default=136, help="prompt tokens in part 2 (the arithmetic prompts' length)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--before", action="store_true", help="also run gptoss as before issue 55 (fresh LM-head "
                   "buffers, the heap handed back after every step)")
    p.add_argument("--no-trl", action="store_true", help="skip TRL's GRPOTrainer (and the step-1 check)")
    p.add_argument("--no-decode", action="store_true", help="skip part 2 (rollout decode against generate's)")
    p.add_argument("overrides", nargs="*", help="recipe overrides for gptoss's runs (key=value)")
    args = p.parse_args()
    harness.check_clock(p, "cpu", args.threads)
    torch.set_num_threads(args.threads)
    arch = bench_arch(args.preset)
    if args.vocab:
        arch = arch.replace(vocab_size=args.vocab)
    with harness.Run("grpo", args, clock="cpu") as run, tempfile.TemporaryDirectory() as tmp:
        result = run_steps(run, args, arch, Path(tmp))
        decode = None if args.no_decode else decode_ratio(run, arch, 16, args.prompt, 16, args.rounds)
    run.extra.update(step_check=result["check"], peak_rss_gb=peak_rss_bytes() / 1e9)
    print(f"preset {args.preset}, vocabulary {arch.vocab_size}, {args.threads} thread(s); peak RSS of the "
          f"process {peak_rss_bytes() / 1e9:.2f} GB")
    print_steps(run, result)
    if decode is not None:
        r, g = decode["rollout_tokens_per_s"], decode["generate_tokens_per_s"]
        print(f"decode, {decode['rows']} rows x ({decode['prompt']} + {decode['new']}) tokens, CPU time: rollout "
              f"{r[0]:.0f} tokens/s [{r[1]:.0f}, {r[2]:.0f}], generate {g[0]:.0f} [{g[1]:.0f}, {g[2]:.0f}]: "
              f"rollout / generate {decode['ratio_text']}")
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
