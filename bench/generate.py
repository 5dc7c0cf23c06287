"""Benchmark `gptoss generate`'s decoding against transformers' `generate`, prefill and decode timed apart.

Both sides hold the same weights (transformers' GptOssForCausalLM with the tests' random weights,
re-arranged into ours by the test-local HF -> Hybrid mapping), fp32 on the CPU, greedy, each with
its KV cache: ours is `gptoss_cli.generate.decode.generate_ids` (the loop `gptoss generate`
runs), transformers' is `model.generate` with its default cache (sliding-window layers bounded)
and its default attention and experts implementations (printed). Every round runs both sides on
the same prompts, in an order that rotates each round; the tokens both sides produce must agree
(the bench stops otherwise, saying where they part).

Each side's time is split at the first new token's logits: prefill (the prompt through the model
and the LM head) and decode (every step after it: choosing a token, one position through the
model, the LM head). Times are this process's CPU time at one thread (`--clock cpu`, default)
or wall time (`--clock wall`, any threads). The headline is the decode ratio (tokens/s ours over
transformers), the median of the per-round ratios with their min-max; prefill and end-to-end
ratios follow. `--batch 8` generates 8 prompts of different lengths (left-padded) as one batch.
The load average during the run is printed with the figures.

    python bench/generate.py --preset tiny --prompt 64 --new 64
    python bench/generate.py --preset medium --prompt 64 --new 64 --rounds 5
    python bench/generate.py --preset wide --prompt 64 --new 64 --batch 8
    python bench/generate.py --gemm --rounds 5

`--gemm` sweeps the decoding step's few-row products alone: `F.linear` (transformers' LM head)
against model/decode/skinny_gemm.py's `skinny_linear` on an LM head and expert weights, 1-16 rows.

Presets: `tiny` (gptoss_cli/model/config.py), `medium` (tiny at hidden 512, 16 experts top-4) and
`wide` (medium with 8 query / 2 kv heads of 64 and a 20480-token vocabulary): bench/peers.py.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench import harness  # noqa: E402
from bench.peers import bench_arch, hf_peer, hybrid_weights  # noqa: E402

import torch  # noqa: E402

CLOCK = harness.cpu_clock


def prompts_for(arch, batch: int, length: int, seed: int = 1) -> list[list[int]]:
    """`batch` random prompts; with several, of lengths length, length - 3, ... (left padding on both sides)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [max(1, length - 3 * i) for i in range(batch)]
    return [torch.randint(0, arch.vocab_size - 3, (n,), generator=g).tolist() for n in lengths]


class _FirstLogits:
    """A transformers LogitsProcessor that notes the clock when the prompt's logits first arrive."""

    def __init__(self):
        self.at = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            self.at = CLOCK()
        return scores


def run_transformers(model, prompts: list[list[int]], new: int) -> tuple[list[list[int]], float, float]:
    """(new tokens per prompt, prefill seconds, decode seconds) of transformers' greedy `generate`."""
    from transformers import GenerationConfig, LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0, use_cache=True)
    first = _FirstLogits()
    t0 = CLOCK()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg,
                             logits_processor=LogitsProcessorList([first]))
    t1 = CLOCK()
    return out[:, width:].tolist(), first.at - t0, t1 - first.at


def run_ours(model, prompts: list[list[int]], new: int) -> tuple[list[list[int]], float, float]:
    """(new tokens per prompt, prefill seconds, decode seconds) of gptoss's `generate_ids`."""
    from gptoss_cli.generate.decode import DecodeTiming, generate_ids

    timing = DecodeTiming(clock=CLOCK)
    gens = generate_ids(model, prompts, max_new_tokens=new, timing=timing)
    return [g.output_ids for g in gens], timing.prefill_s, timing.decode_s


def run_ours_without_expert_gemms(model, prompts: list[list[int]], new: int) -> tuple[list[list[int]], float, float]:
    """`run_ours` with a decoding step's expert GEMMs replaced by zeros of their shape (--ceiling):
    what the rest of a step costs. Its tokens are not compared (they are not the model's)."""
    from gptoss_cli.model.decode import moe as moe_decode

    real = moe_decode._expert_gemm
    moe_decode._expert_gemm = lambda x, lin, *rest: x.new_zeros(x.shape[0], lin.weight.shape[1])
    try:
        return run_ours(model, prompts, new)
    finally:
        moe_decode._expert_gemm = real


def build(arch):
    from gptoss_cli.model.hybrid import HybridModel

    peer = hf_peer(arch, torch.float32).eval()
    ours = HybridModel(arch).eval()
    ours.load_state_dict(hybrid_weights(arch, peer), strict=True)
    return ours, peer


def first_difference(a: list[list[int]], b: list[list[int]]) -> str | None:
    for row, (x, y) in enumerate(zip(a, b)):
        for i, (s, t) in enumerate(zip(x, y)):
            if s != t:
                return f"prompt {row}, new token {i}: ours {s}, transformers {t}"
        if len(x) != len(y):
            return f"prompt {row}: ours {len(x)} new tokens, transformers {len(y)}"
    return None


# --gemm: the decoding step's few-row products (model/decode/skinny_gemm.py) against F.linear, which
# transformers' LM head (nn.Linear) runs. Weights as [out, in], fp32, several copies of each so the
# sweep reads them from memory as a decoding step does (a step reads every layer's weights once).
GEMM_WEIGHTS = {"wide LM head": (20480, 512), "GPT-OSS expert fc1": (5760, 2880), "medium expert fc1": (1024, 512)}
GEMM_ROWS = (1, 2, 4, 8, 12, 16)
GEMM_BYTES = 192 << 20  # of each weight shape, in copies (at least 2: more than the last-level cache)


def gemm_sweep(run: harness.Run, rounds: int) -> None:
    """GB/s of weight read by F.linear and by skinny_linear per weight shape and row count, in rounds
    alternating which goes first (medians); the largest difference between their outputs."""
    import torch.nn.functional as F

    from gptoss_cli.model.decode.skinny_gemm import blocked, skinny_linear

    run.extra["max_abs_diff"], run.extra["blocked"] = {}, {}
    for label, (rows_out, cols) in GEMM_WEIGHTS.items():
        copies = max(2, GEMM_BYTES // (rows_out * cols * 4))
        weights = [torch.randn(rows_out, cols) for _ in range(copies)]
        gb = copies * rows_out * cols * 4 / 1e9
        for m in GEMM_ROWS:
            x = torch.randn(m, cols)
            fns = {"F.linear": lambda: [F.linear(x, w) for w in weights],
                   "skinny_linear": lambda: [skinny_linear(x, w) for w in weights]}
            timed = harness.interleave(fns, rounds, warmup=0, clock="cpu")
            case = f"{label} {rows_out}x{cols} rows {m}"
            for name in fns:
                run.add(case, name, "read_gbps", [gb / s for s in timed[name]["time_s"]])
            ratio = run.ratio(case, "skinny_linear", "F.linear", "read_gbps")["median"]
            diff = float((F.linear(x, weights[0]) - skinny_linear(x, weights[0])).abs().max())
            run.extra["max_abs_diff"][case], run.extra["blocked"][case] = diff, blocked(x, weights[0])
            rates = {n: run.cases[case]["settings"][n]["read_gbps"]["median"] for n in fns}
            print(f"  {label:<20} {rows_out:>5} x {cols:<5} rows {m:>2}: F.linear {rates['F.linear']:5.1f} GB/s, "
                  f"skinny_linear {rates['skinny_linear']:5.1f} GB/s ({'blocked' if blocked(x, weights[0]) else 'whole'}), "
                  f"ratio {ratio:.2f}x, max |diff| {diff:.1e}", flush=True)


def compare(run: harness.Run, args, ours, peer, prompts) -> int:
    """The decoding rounds of ours against transformers (and ours without expert GEMMs: --ceiling)."""
    def timed(fn):
        return lambda: dict(zip(("prefill_s", "decode_s"), fn(prompts, args.new)[1:]))

    sides = {"ours": lambda p, n: run_ours(ours, p, n), "transformers": lambda p, n: run_transformers(peer, p, n)}
    tokens = {name: fn(prompts, args.new)[0] for name, fn in sides.items()}  # warm-up, and the tokens to compare
    diff = first_difference(tokens["ours"], tokens["transformers"])
    if diff is not None:
        print(f"bench: the two sides generate different tokens ({diff}); they do not compute the same thing")
        return 1
    if args.ceiling:
        sides["ours_without_expert_gemms"] = lambda p, n: run_ours_without_expert_gemms(ours, p, n)
    rounds = harness.interleave({name: timed(fn) for name, fn in sides.items()}, args.rounds, warmup=0,
                                clock=args.clock)
    for name in sides:
        rounds[name]["total_s"] = [a + b for a, b in zip(rounds[name]["prefill_s"], rounds[name]["decode_s"])]
    new_tokens = args.batch * (args.new - 1)  # decode steps after the first token
    for name in sides:
        rounds[name]["decode_tokens_per_s"] = [new_tokens / s for s in rounds[name]["decode_s"]]
    case = f"{args.preset}{' ' + args.arch if args.arch else ''} batch {args.batch}"
    run.add_rounds(case, rounds, ("prefill_s", "decode_s", "total_s", "decode_tokens_per_s"))
    for part in ("decode", "prefill", "total"):
        run.ratio(case, "transformers", "ours", f"{part}_s", name=f"ours / transformers speed, {part}")
    print(f"{args.preset}{' ' + args.arch if args.arch else ''}: batch {args.batch} (prompts of "
          f"{', '.join(str(len(p)) for p in prompts)} tokens), {args.new} new tokens each, greedy, fp32, "
          f"{args.threads} thread(s), {args.clock} clock, {args.rounds} rounds; same tokens on both sides")
    for name in sides:
        print(f"  {name:<13} prefill {rounds.median(name, 'prefill_s') * 1e3:8.1f} ms   decode "
              f"{rounds.median(name, 'decode_s') * 1e3:8.1f} ms ({rounds.median(name, 'decode_tokens_per_s'):7.1f} tokens/s)")
    ratios = {part: harness.ratio_text(rounds.ratios("transformers", "ours", f"{part}_s"))
              for part in ("decode", "prefill", "total")}
    print(f"ours / transformers, median [min, max] of the per-round ratios: decode {ratios['decode']}, "
          f"prefill {ratios['prefill']}, end to end {ratios['total']}")
    if args.ceiling:
        decode = rounds["ours"]["decode_s"]
        experts = [o - n for o, n in zip(decode, rounds["ours_without_expert_gemms"]["decode_s"])]
        share = statistics.median([e / o for e, o in zip(experts, decode)])
        run.extra["ours_expert_gemm_share_of_decode"] = share
        run.extra["ratio_decode_ceiling"] = statistics.median(
            [t / e if e > 0 else float("inf") for t, e in zip(rounds["transformers"]["decode_s"], experts)])
        if share <= 0.05:
            print("ours' decoding step: the expert GEMMs are within this host's noise (no ceiling from them)")
        else:
            print(f"ours' decoding step: the expert GEMMs {share:.0%} of it; "
                  f"decode ratio were everything else of ours free: {run.extra['ratio_decode_ceiling']:.2f}x")
    return 0


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--preset", default="tiny", help="tiny, medium, wide or a model preset")
    ap.add_argument("--arch", default=None, help="integer architecture overrides, e.g. num_hidden_layers=4")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (the longest prompt with --batch)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt (no stop token: all of them)")
    ap.add_argument("--batch", type=int, default=1, help="prompts generated as one batch")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", default="cpu", choices=tuple(harness.CLOCKS))
    ap.add_argument("--ceiling", action="store_true",
                    help="also time ours without a decoding step's expert GEMMs (a third side in the rotation) and "
                         "print the ratio's ceiling were everything else free")
    ap.add_argument("--gemm", action="store_true",
                    help="instead: the decoding step's few-row products, F.linear against model/decode/skinny_gemm.py, GB/s")
    args = ap.parse_args()
    global CLOCK
    harness.check_clock(ap, args.clock, args.threads)
    CLOCK = harness.CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    if args.gemm:
        print(f"few-row products x @ W^T, fp32, {args.threads} thread(s), CPU clock, {args.rounds} rounds, "
              "GB/s of weight read (medians)")
        with harness.Run("generate --gemm", args, clock="cpu") as run:
            gemm_sweep(run, args.rounds)
        run.finish()
        return 0
    arch = bench_arch(args.preset, args.arch)
    ours, peer = build(arch)
    prompts = prompts_for(arch, args.batch, args.prompt)
    with harness.Run("generate", args) as run:
        run.extra.update(prompt_lengths=[len(p) for p in prompts], allocator=harness.allocator_text(False),
                         dtype="float32", transformers_attn_implementation=peer.config._attn_implementation,
                         transformers_experts_implementation=getattr(peer.config, "_experts_implementation", None))
        code = compare(run, args, ours, peer, prompts)
    if code == 0:
        run.finish()
    return code


if __name__ == "__main__":
    sys.exit(main())
