"""Benchmark serve-check's wall time against the engine's own load + prefill time.

What a user pays for the proof beyond serving the prompts once: `gptoss serve-check` end to end (the
export, gptoss's forward with its greedy continuation and near-tie flips, starting the engine's
interpreter and importing vLLM, vLLM's load, scoring, greedy generation, the comparison) against the
time vLLM itself spends building its `LLM` on the folder and prefilling the same prompts with prompt
logprobs (both timed inside the engine's process, so they are vLLM's own figures from the same run).

The model is a GPT-OSS of the real layout written by `make-tiny` with head_dim 64 (vLLM's CPU
attention needs it) and the sizes given; the engine is vLLM from --engine-python or
$GPTOSS_ENGINE_PYTHON. Each repeat starts a fresh engine process. Prints the medians of each part and
the ratio check / (load + prefill), the median of the per-repeat ratios; `--json FILE` writes them.

    python bench/serve_check.py --engine-python /work/engine-venv/bin/python --repeats 3
    python bench/serve_check.py --hidden 256 --intermediate 256 --layers 4 --experts 8 --vocab 8000
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from gptoss_cli.checkpoint.make_tiny import make_tiny  # noqa: E402
from gptoss_cli.model.config import preset  # noqa: E402
from gptoss_cli.parity.serve.check import ServeCheckOptions, serve_check  # noqa: E402


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--engine-python", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=96)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1003)
    ap.add_argument("--window", type=int, default=16)
    args = ap.parse_args()

    arch = preset("tiny").replace(head_dim=64, sliding_window=args.window, num_hidden_layers=args.layers,
                                  hidden_size=args.hidden, intermediate_size=args.intermediate,
                                  num_local_experts=args.experts, vocab_size=args.vocab)
    if args.engine_python is None and not os.environ.get("GPTOSS_ENGINE_PYTHON"):
        ap.error("no Python interpreter with vLLM: pass --engine-python PATH or set GPTOSS_ENGINE_PYTHON "
                 "(docs/serve-check.md)")
    with harness.Run("serve_check", args, clock="wall") as run, tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_tiny(model, experts="bf16", dtype="float32", arch=arch)

        def check() -> dict:
            report = serve_check(str(model), ServeCheckOptions(engine_python=args.engine_python, dtype=args.dtype))
            s = report.seconds
            parts = {"engine_load_s": s["engine_load"], "engine_prefill_s": s["engine_prefill"],
                     "interpreter_and_import_s": s["engine_start"] - s["engine_load"],
                     "gptoss_forward_s": s["gptoss_forward"], "export_s": s["export"]}
            print(f"check: vLLM load {s['engine_load']:.1f} s + prefill {s['engine_prefill']:.1f} s, "
                  f"interpreter + import {parts['interpreter_and_import_s']:.1f} s, gptoss {s['gptoss_forward']:.1f} s "
                  f"({report.verdict})", flush=True)
            return parts

        # one side: a fresh engine per repeat; vLLM's own load + prefill are timed inside that same run
        timed = harness.interleave({"serve-check": check}, args.repeats, warmup=0, clock="wall")
    case = f"tiny head-64 model, {args.layers} layers, {args.dtype}"
    run.add_rounds(case, timed)
    engine = [lo + p for lo, p in zip(timed["serve-check"]["engine_load_s"], timed["serve-check"]["engine_prefill_s"])]
    run.add(case, "vLLM load + prefill", "time_s", engine)
    ratio = run.ratio(case, "serve-check", "vLLM load + prefill")["median"]
    med = {k: timed.median("serve-check", k) for k in timed["serve-check"]}
    print(f"median check {med['time_s']:.1f} s; vLLM's own load + prefill {run.cases[case]['settings']['vLLM load + prefill']['time_s']['median']:.1f} s; "
          f"ratio {ratio:.2f} (interpreter start + vLLM import {med['interpreter_and_import_s']:.1f} s, "
          f"gptoss's side {med['gptoss_forward_s']:.1f} s)")
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
