"""Benchmark `gptoss convert --to gguf` against llama.cpp's own converter (convert_hf_to_gguf.py, what users run
today) on the same HF checkpoint with gpt-oss-20b's dimensions, in one run.

The checkpoint is synthetic (make-tiny's writer with the 20B architecture: hidden = intermediate = 2880, 64/8
heads of 64, 32 MXFP4 experts per block, the real 201088-token vocabulary and o200k tokenizer, random weights)
with --layers blocks (24 real). Each side converts it to BF16 with MXFP4 experts in a fresh process, in
interleaved rounds (gptoss, llama.cpp, then llama.cpp, gptoss, ...); per side the wall seconds and the peak
RSS of the converting process (its own VmHWM), and per round gptoss's time over llama.cpp's.
llama.cpp's converter comes from llama.cpp's source (--llamacpp-src: the folder holding convert_hf_to_gguf.py,
e.g. llama-cpp-python's sdist's vendor/llama.cpp), run by this interpreter (it needs torch, transformers, numpy).

    python bench/gguf.py --llamacpp-src /tmp/llama_cpp_python-0.3.36/vendor/llama.cpp --layers 24 --rounds 3
    python bench/gguf.py --llamacpp-src ... --layers 1 --hidden 64 --rounds 1     # a smoke run
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402


def make_checkpoint(dst: Path, layers: int, hidden: int) -> Path:
    from gptoss_cli.model.config import preset
    from tests.checkpoint.gguf_fixtures import real_vocab_tiny

    base = preset("gpt_oss_20b")
    heads = max(1, hidden * base.num_attention_heads // base.hidden_size)
    changes = dict(num_hidden_layers=layers, num_local_experts=base.num_local_experts,
                   num_experts_per_tok=base.num_experts_per_tok, hidden_size=hidden, intermediate_size=hidden,
                   num_attention_heads=heads, num_key_value_heads=max(1, heads // 8), sliding_window=128)
    return real_vocab_tiny(dst, **changes)


def run_side(cmd: list[str], log: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (bytes: the process's own VmHWM, harness.run_with_peak) of one converting process."""
    with open(log, "wb") as err:
        code, wall, peak = harness.run_with_peak(cmd, log.with_suffix(".peak"), stdout=subprocess.DEVNULL, stderr=err)
    if code != 0:
        raise SystemExit(f"{cmd[1]} failed (exit {code}): {log.read_text(errors='replace')[-500:]}")
    return wall, peak


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--llamacpp-src", type=Path, required=True, help="the folder holding convert_hf_to_gguf.py")
    ap.add_argument("--layers", type=int, default=2, help="blocks of the 20B architecture (24 real)")
    ap.add_argument("--hidden", type=int, default=2880, help="hidden = intermediate size (2880 real; smaller: a smoke run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    converter = args.llamacpp_src / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise SystemExit(f"--llamacpp-src {args.llamacpp_src}: no convert_hf_to_gguf.py there")
    work = Path(tempfile.mkdtemp(prefix="gptoss-bench-gguf-", dir=args.workdir))
    try:
        src = make_checkpoint(work / "hf", args.layers, args.hidden)
        peaks: dict[str, list[float]] = {"gptoss": [], "llama.cpp": []}
        sides_cmd = {
            "gptoss": [sys.executable, "-c", "from gptoss_cli.cli import main; main()", "convert", str(src), str(work / "ours.gguf"), "--to",
                       "gguf", "--dtype", "bf16", "--force", "--quiet"],
            "llama.cpp": [sys.executable, str(converter), str(src), "--outfile", str(work / "theirs.gguf"),
                          "--outtype", "bf16"],
        }

        def side(name: str):
            def call():
                wall, peak = run_side(sides_cmd[name], work / f"{name}.log")
                peaks[name].append(peak)
                return wall
            return call

        with harness.Run("gguf", args, clock="wall") as run:
            rounds = harness.interleave({n: side(n) for n in sides_cmd}, args.rounds, warmup=0, clock="wall")
            case = f"{args.layers} blocks, hidden {args.hidden}"
            run.add_rounds(case, rounds)
            for name, values in peaks.items():
                run.add(case, name, "peak_rss_bytes", values)
            entry = run.ratio(case, "gptoss", "llama.cpp", name="gptoss / llama.cpp (time)")
            print(f"{case}: gptoss / llama.cpp time {harness.ratio_text(entry['values'])}; peak RSS gptoss "
                  f"{max(peaks['gptoss']) / 2**30:.2f} GiB, llama.cpp {max(peaks['llama.cpp']) / 2**30:.2f} GiB")
        run.finish()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
