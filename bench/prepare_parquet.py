"""prepare-data --format harmony over a large Parquet file: peak memory and tokens/s, against the JSONL path.

Synthetic agent traces (a developer message declaring two function tools, a user question, analysis, one to
three tool calls with results, a final answer; words drawn from a fixed vocabulary with some Unicode, so the
text tokenizes like prose; 40,000 distinct ones, repeated to fill the large file) are written as harmony's JSON,
one conversation per row: a JSONL file and a
Parquet file (snappy, the column `conversation`) of the same rows for the comparison, and one Parquet file
of --gb gigabytes for the memory bound. Each prepare-data run is its own process (`python -m gptoss_cli`),
timed by wall clock, its peak RSS its own VmHWM (harness.run_with_peak). The comparison alternates JSONL and Parquet runs
(--rounds each) and prints the median tokens/s of each and their ratio (the median of the per-round ratios); the large file runs once, with the
subset's Parquet peak RSS beside it (memory bounded by a batch of rows means the two stay close).

The tokenizer is the real GPT-OSS one, built offline from the test extra's bpe-openai (tests/data/
harmony_tokenizer.py). Example: python bench/prepare_parquet.py --gb 1 --compare-mb 64 --rounds 2
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import harness  # noqa: E402

WORDS: list[str] = []
UNIQUE_CHUNKS = 8  # of --chunk-rows conversations (5,000 by default: about 190 MB of JSON); the large file repeats them


def _words(rng: random.Random) -> list[str]:
    syllables = ["ka", "to", "ri", "mu", "sen", "lo", "va", "qui", "der", "an", "el", "or", "ph", "th", "ing", "ous"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(6000)]
    return words + ["東京", "données", "naïve", "🤖", "Straße", "3.14", "2026", "<|end|>", "e.g.", "(x)"]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


TOOLS = {"functions": {"name": "functions", "tools": [
    {"name": "search", "description": "Searches the knowledge base.", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "description": "what to look for"},
                                         "limit": {"type": "integer", "default": 5}}, "required": ["query"]}},
    {"name": "fetch", "description": "Fetches a document by id.", "parameters": {
        "type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}]}}


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": [{"type": "system_content", "reasoning_effort": "Low"}]},
                {"role": "developer", "content": [{"type": "developer_content", "instructions": _text(rng, 12),
                                                   "tools": TOOLS}]},
                {"role": "user", "content": _text(rng, rng.randint(10, 60))},
                {"role": "assistant", "channel": "analysis", "content": _text(rng, rng.randint(20, 80))}]
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(["search", "fetch"])
        args = {"query": _text(rng, 4)} if name == "search" else {"id": f"doc-{rng.randint(0, 10**6)}"}
        messages.append({"role": "assistant", "channel": "commentary", "recipient": f"functions.{name}",
                         "content_type": "<|constrain|>json", "content": json.dumps(args, ensure_ascii=False)})
        messages.append({"role": "tool", "name": f"functions.{name}", "recipient": "assistant",
                         "channel": "commentary", "content": _text(rng, rng.randint(40, 300))})
    messages.append({"role": "assistant", "channel": "final", "content": _text(rng, rng.randint(20, 120))})
    return {"messages": messages}


def write_data(folder: Path, gb: float, compare_mb: float, compression: str, seed: int = 0,
               chunk: int = 5000) -> tuple[Path, Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    global WORDS
    rng = random.Random(seed)
    WORDS = _words(rng)
    big, small_pq, small_jl = folder / "big.parquet", folder / "small.parquet", folder / "small.jsonl"
    schema = pa.schema([("id", pa.int64()), ("conversation", pa.string())])
    n = 0
    with pq.ParquetWriter(big, schema, compression=compression) as w_big, \
            pq.ParquetWriter(small_pq, schema, compression=compression) as w_small, small_jl.open("w") as jl:
        small_bytes = 0
        chunks: list[list[str]] = []
        while not big.exists() or big.stat().st_size < gb * 1e9:
            if len(chunks) < UNIQUE_CHUNKS:  # then cycled: the text generator, not the file, is the slow part
                chunks.append([json.dumps(conversation(rng), ensure_ascii=False) for _ in range(chunk)])
            rows = chunks[(n // chunk) % len(chunks)]
            table = pa.table({"id": list(range(n, n + len(rows))), "conversation": rows})
            w_big.write_table(table, row_group_size=chunk)
            if small_bytes < compare_mb * 1e6:
                w_small.write_table(table, row_group_size=chunk)
                jl.write("".join(r + "\n" for r in rows))
                small_bytes += sum(len(r) + 1 for r in rows)
            n += len(rows)
            print(f"\rwriting: {n:,} rows, {big.stat().st_size / 1e9:.2f} GB", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return big, small_pq, small_jl


def tokenizer_rss(tokenizer: Path) -> float:
    """Peak RSS (MiB) of a process that only loads the tokenizer: the floor under every prepare-data run."""
    _, _, peak = harness.run_with_peak([sys.executable, "-c", "import sys; from tokenizers import Tokenizer; "
                                        "Tokenizer.from_file(sys.argv[1])", str(tokenizer)],
                                       tokenizer.with_name("tokenizer-only.peak"))
    return peak / 2**20


def run_prepare(source: Path, tokenizer: Path, out: Path, field: bool) -> dict:
    report = out.with_name(out.name + "-report.json")
    cmd = [sys.executable, "-m", "gptoss_cli", "prepare-data", str(source), "--format", "harmony", "--tokenizer",
           str(tokenizer), "--out", str(out), "--quiet", "--json", str(report)] + (["--field", "conversation"]
                                                                                   if field else [])
    code, seconds, peak = harness.run_with_peak(cmd, out.with_name(out.name + ".peak"), cwd=ROOT)
    if code != 0:
        raise SystemExit(f"prepare-data failed on {source}")
    result = json.loads(report.read_text())
    for suffix in (".bin", ".idx", ".mask"):
        out.with_suffix(suffix).unlink()
    return {"tokens": result["num_tokens"], "documents": result["num_documents"], "seconds": seconds,
            "tokens_per_s": result["num_tokens"] / seconds, "peak_rss_mib": peak / 2**20}


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--gb", type=float, default=1.0, help="size of the large Parquet file")
    ap.add_argument("--compare-mb", type=float, default=64, help="size of the JSONL / Parquet comparison data")
    ap.add_argument("--rounds", type=int, default=2, help="alternating JSONL / Parquet runs each")
    ap.add_argument("--compression", default="snappy", help="Parquet compression (snappy, zstd, none)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gptoss-bench-prepare-parquet"))
    ap.add_argument("--chunk-rows", type=int, default=5000,
                    help="conversations per written batch and row group (the smallest unit of each file)")
    args = ap.parse_args()
    from tests.data.harmony_tokenizer import gpt_oss_tokenizer_json

    run = harness.Run("prepare_parquet", args, clock="wall").__enter__()
    args.workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = gpt_oss_tokenizer_json(args.workdir / "tokenizer")
    big, small_pq, small_jl = write_data(args.workdir, args.gb, args.compare_mb, args.compression,
                                          chunk=args.chunk_rows)
    floor = tokenizer_rss(tokenizer)

    def side(kind: str, source: Path):
        def once() -> dict:
            out = run_prepare(source, tokenizer, args.workdir / f"out-{kind}", kind == "parquet")
            print(f"{kind:8s} {out}", file=sys.stderr)
            return out
        return once

    timed = harness.interleave({"jsonl": side("jsonl", small_jl), "parquet": side("parquet", small_pq)}, args.rounds,
                               warmup=0, clock="wall")
    case = f"{args.compare_mb:g} MB of agent traces"
    run.add_rounds(case, timed, ("tokens_per_s", "peak_rss_mib"))
    ratio = run.ratio(case, "parquet", "jsonl", "tokens_per_s")["median"]
    large = run_prepare(big, tokenizer, args.workdir / "out-big", True)
    large_case = f"{big.stat().st_size / 1e9:.2f} GB Parquet file"
    run.add(large_case, "parquet", "tokens_per_s", large["tokens_per_s"])
    run.add(large_case, "parquet", "peak_rss_mib", large["peak_rss_mib"])
    run.add(large_case, "tokenizer alone", "peak_rss_mib", floor)
    run.extra.update(big_file_bytes=big.stat().st_size, large=large,
                     compare_bytes={"jsonl": small_jl.stat().st_size, "parquet": small_pq.stat().st_size})
    med = {k: timed.median(k, "tokens_per_s") for k in ("jsonl", "parquet")}
    print(f"comparison ({small_jl.stat().st_size / 1e6:.0f} MB JSONL, {small_pq.stat().st_size / 1e6:.0f} MB "
          f"Parquet, {timed.returned['jsonl']['tokens']:,} tokens): JSONL {med['jsonl']:,.0f} tokens/s, Parquet "
          f"{med['parquet']:,.0f} tokens/s, ratio {ratio:.2f}; peak RSS JSONL "
          f"{max(timed['jsonl']['peak_rss_mib']):.0f} MiB, Parquet {max(timed['parquet']['peak_rss_mib']):.0f} MiB")
    print(f"large Parquet {big.stat().st_size / 1e9:.2f} GB, {large['documents']:,} conversations, "
          f"{large['tokens']:,} tokens in {large['seconds']:.0f} s: {large['tokens_per_s']:,.0f} tokens/s, "
          f"peak RSS {large['peak_rss_mib']:.0f} MiB (loading the tokenizer alone: {floor:.0f} MiB)")
    run.finish()


if __name__ == "__main__":
    main()
