"""Benchmark serve-check's wall time against the engine's own load + prefill time.

What a user pays for the proof beyond serving the prompts once: `gptoss serve-check` end to end (the
export, gptoss's forward with its greedy continuation and near-tie flips, starting the engine's
interpreter and importing vLLM, vLLM's load, scoring, greedy generation, the comparison) against the
time vLLM itself spends building its `LLM` on the folder and prefilling the same prompts with prompt
logprobs (both timed inside the engine's process, so they are vLLM's own figures from the same run).

The model is a GPT-OSS of the real layout written by `make-tiny` with head_dim 64 (vLLM's CPU
attention needs it) and the sizes given; the engine is vLLM from --engine-python or
$GPTOSS_ENGINE_PYTHON. Each repeat starts a fresh engine process. Prints the medians of each part and
the ratio check / (load + prefill); `--json FILE` writes them.

    python bench/serve_check.py --engine-python /work/engine-venv/bin/python --repeats 3
    python bench/serve_check.py --hidden 256 --intermediate 256 --layers 4 --experts 8 --vocab 8000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gptoss_cli.checkpoint.make_tiny import make_tiny  # noqa: E402
from gptoss_cli.model.config import preset  # noqa: E402
from gptoss_cli.outputs import replace_text  # noqa: E402
from gptoss_cli.parity.serve.check import ServeCheckOptions, serve_check  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine-python", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=96)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1003)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    arch = preset("tiny").replace(head_dim=64, sliding_window=args.window, num_hidden_layers=args.layers,
                                  hidden_size=args.hidden, intermediate_size=args.intermediate,
                                  num_local_experts=args.experts, vocab_size=args.vocab)
    parts: dict[str, list[float]] = {k: [] for k in ("check", "engine_load", "prefill", "import", "gptoss", "export")}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_tiny(model, experts="bf16", dtype="float32", arch=arch)
        for r in range(args.repeats):
            t0 = time.perf_counter()
            report = serve_check(str(model), ServeCheckOptions(engine_python=args.engine_python, dtype=args.dtype))
            wall = time.perf_counter() - t0
            s = report.seconds
            prefill = s["engine_prefill"]  # vLLM's generate call with prompt logprobs, timed in its process
            parts["check"].append(wall)
            parts["engine_load"].append(s["engine_load"])
            parts["prefill"].append(prefill)
            parts["import"].append(s["engine_start"] - s["engine_load"])
            parts["gptoss"].append(s["gptoss_forward"])
            parts["export"].append(s["export"])
            print(f"repeat {r}: check {wall:.1f} s, vLLM load {s['engine_load']:.1f} s + prefill {prefill:.1f} s, "
                  f"interpreter + import {s['engine_start'] - s['engine_load']:.1f} s, gptoss {s['gptoss_forward']:.1f} s "
                  f"({report.verdict})", flush=True)
    med = {k: statistics.median(v) for k, v in parts.items()}
    ratio = statistics.median(c / (lo + p) for c, lo, p in zip(parts["check"], parts["engine_load"], parts["prefill"]))
    print(f"median check {med['check']:.1f} s; vLLM's own load + prefill {med['engine_load'] + med['prefill']:.1f} s; "
          f"ratio {ratio:.2f} (interpreter start + vLLM import {med['import']:.1f} s, gptoss's side {med['gptoss']:.1f} s)")
    if args.json is not None:
        replace_text(args.json, json.dumps({"args": vars(args) | {"json": str(args.json)}, "medians": med,
                                            "ratio": ratio, "runs": parts}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
