"""Benchmark a GRPO step: rollout against training time, the rollout's decode against `generate`'s, peak memory.

Part 1, the step: `tiny_cpu_grpo` (1 process, gptoss rollouts, builtin:arithmetic prompts, even_tokens) run
by `gptoss train`'s worker on a randomly initialised model of `--preset` for `--steps` steps; from its
metrics.jsonl, per step after the first (warm-up), the median rollout time (sampling plus scoring and the
old/reference log-probabilities), training time and the rollout's share of the step; the process's peak
RSS (ru_maxrss) after the run.

Part 2, the decode: the same rows of completions sampled by the rollout engine (`rl/sampling.py`
`sample_completions`, which also returns each token's log-probability) and by `generate`'s loop
(`generate/decode.py` `generate_ids`, the same temperature-1 sampling) on one model and the same prompts,
no stop token (every row decodes `--new` tokens), in rounds whose order rotates; CPU time at one thread.
The headline is rollout tokens/s over generate's, the median of the per-round ratios with min-max.

    python bench/grpo.py --preset tiny --steps 6 --rounds 5
    python bench/grpo.py --preset medium --steps 4 --rounds 3 --json grpo.json
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench import harness  # noqa: E402
from bench.peers import bench_arch  # noqa: E402

import torch  # noqa: E402


def grpo_step_times(run: harness.Run, arch, steps: int, folder: Path, overrides: list[str]) -> dict:
    """Run tiny_cpu_grpo's settings on `arch` for `steps` steps; medians of its per-step times (and
    each step's, recorded as the `step` case)."""
    from gptoss_cli.data.tiny_tokenizer import tiny_tokenizer
    from gptoss_cli.recipe import load_recipe
    from gptoss_cli.model.pattern import default_pattern
    from gptoss_cli.train.job import TrainJob
    from gptoss_cli.run.worker import run_worker

    tok = folder / "tokenizer.json"
    tok.write_text(json.dumps(tiny_tokenizer(arch.vocab_size)))
    recipe = load_recipe("tiny_cpu_grpo", [f"training.train_iters={steps}", "checkpoint.pretrained=null",
                                           "checkpoint.dir=null", f"rl.tokenizer={tok}",
                                           f"logging.run_dir={folder / 'run'}", *overrides])
    job = TrainJob(config=recipe.config, arch=arch, pattern=default_pattern(arch), name="bench",
                   run_dir=str(folder / "run"))
    run_worker(job)
    rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("rank", 0) == 0][1:] or rows
    rollout = statistics.median(r["rollout_time_s"] for r in rows)
    train = statistics.median(r["train_time_s"] for r in rows)
    run.add("step", "gptoss", "rollout_s", [r["rollout_time_s"] for r in rows])
    run.add("step", "gptoss", "train_s", [r["train_time_s"] for r in rows])
    run.add("step", "gptoss", "rollout_tokens_per_s", [r["rollout_tokens_per_s"] for r in rows])
    return {"steps_timed": len(rows), "rollout_s": rollout, "train_s": train, "rollout_share": rollout / (rollout + train),
            "rollout_tokens_per_s": statistics.median(r["rollout_tokens_per_s"] for r in rows),
            "completion_length": statistics.median(r["completion_length"] for r in rows),
            "reward_first": rows[0]["reward_mean"], "reward_last": rows[-1]["reward_mean"],
            "rows": recipe.config.training.global_batch_size, "max_new_tokens": recipe.config.rl.max_new_tokens,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}


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


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--preset", default="tiny", help="tiny, medium or wide (bench/peers.py)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt", type=int, default=136, help="prompt tokens in part 2 (the arithmetic prompts' length)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("overrides", nargs="*", help="recipe overrides for part 1 (key=value)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    arch = bench_arch(args.preset)
    with harness.Run("grpo", args, clock="cpu") as run, tempfile.TemporaryDirectory() as tmp:
        step = grpo_step_times(run, arch, args.steps, Path(tmp), args.overrides)
        decode = decode_ratio(run, arch, step["rows"], args.prompt, step["max_new_tokens"], args.rounds)
    run.add("step", "gptoss", "peak_rss_gb", step["peak_rss_gb"])
    run.extra["step"] = step
    print(f"preset {args.preset}, {args.threads} thread(s)")
    print(f"GRPO step ({step['rows']} completions of up to {step['max_new_tokens']} tokens, median over "
          f"{step['steps_timed']} steps): rollout {step['rollout_s']:.3f} s, train {step['train_s']:.3f} s, rollout "
          f"{100 * step['rollout_share']:.0f}% of the step; rollout {step['rollout_tokens_per_s']:.0f} tokens/s; "
          f"reward {step['reward_first']:.2f} -> {step['reward_last']:.2f}; peak RSS {step['peak_rss_gb']:.2f} GB")
    r, g = decode["rollout_tokens_per_s"], decode["generate_tokens_per_s"]
    print(f"decode, {decode['rows']} rows x ({decode['prompt']} + {decode['new']}) tokens, CPU time: rollout "
          f"{r[0]:.0f} tokens/s [{r[1]:.0f}, {r[2]:.0f}], generate {g[0]:.0f} [{g[1]:.0f}, {g[2]:.0f}]: rollout / "
          f"generate {decode['ratio_text']}")
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
