"""Benchmark `gptoss convert` on a synthetic checkpoint with the real GPT-OSS 120B dimensions.

For 1, 2 and 4 blocks (MXFP4 experts, hidden = intermediate = 2880, 128 experts, 64/8 heads,
vocab 201088) it converts HF -> Hybrid in a fresh process and prints:
  * throughput ratio: output bytes/s of the conversion divided by bytes/s of a plain file copy of
    the same output (copy + fsync of the copy; convert's time includes fsync of its outputs),
    timed in the same run (median over --repeats); like convert's
    source, the copy's source is in the page cache (read once, untimed, before each file's copy);
  * peak RSS of the converting process (must stay flat as blocks are added);
  * the rate of each stage, measured inside the same conversions, so that a reader sees which one
    bounds the run on their machine: read GB/s and decode GB/s per worker thread (source bytes
    read, output bytes produced per busy second; times the worker count for the stage's capacity),
    and write GB/s (output bytes per second of the writer thread's file I/O plus the final sync).
Before that, a decode micro-benchmark on one 120B expert stack (128 experts x 5760 rows x 90
groups x 16 bytes, decoded expert by expert as convert does) compares today's decode with the one
before issue 16, kept below as the baseline, and checks that both give identical bits.
Targets (issue 16): ratio >= 0.8, peak RSS < 4 GiB, decode >= 3x the baseline.

Run it once as is and once with torch's AVX2 kernels (CPUs without native bf16 arithmetic):

    python bench/convert.py --blocks 1 2 4 --repeats 3 --workdir /tmp/gptoss-bench
    ATEN_CPU_CAPABILITY=avx2 python bench/convert.py --blocks 1 2 4 --repeats 3 --workdir /tmp/gptoss-bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from gptoss_cli.checkpoint import mxfp4
from gptoss_cli.checkpoint.convert_plan import plan_to_hf
from gptoss_cli.checkpoint.layouts import HF_MXFP4
from gptoss_cli.checkpoint.mapping import units
from gptoss_cli.checkpoint.pipeline import worker_count
from gptoss_cli.checkpoint.safetensors_io import ShardedWriter
from gptoss_cli.checkpoint.hf_config import to_hf_config
from gptoss_cli.model.config import preset
from gptoss_cli.resources import keep_freed_memory


# --- the decode before issue 16, the baseline of the micro-benchmark -----------------------
_old_pairs: dict[torch.dtype, torch.Tensor] = {}
_old_scales: dict[torch.dtype, torch.Tensor] = {}


def decode_before_issue_16(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
    """int32 index_select of a byte -> value-pair table, then a multiply by 2**(scale - 127) in `dtype`."""
    if dtype not in _old_pairs:
        vals = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float32)
        b = torch.arange(256)
        pairs = torch.stack([vals[b & 0xF], vals[b >> 4]], dim=-1).to(dtype).contiguous()
        _old_pairs[dtype] = pairs.view({2: torch.int32, 4: torch.int64}[pairs.element_size()]).reshape(256)
        lut = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - 127)
        lut[255] = float("nan")
        _old_scales[dtype] = lut.to(dtype)
    values = _old_pairs[dtype].index_select(0, blocks.reshape(-1).int()).view(dtype)
    values = values.reshape(*scales.shape, mxfp4.GROUP)
    values.mul_(_old_scales[dtype].index_select(0, scales.reshape(-1).int()).reshape(*scales.shape, 1))
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * mxfp4.GROUP)


def decode_microbench(rounds: int) -> None:
    """Decode one 120B gate_up stack expert by expert (convert's task size) with each decoder."""
    experts, rows, groups = 128, 5760, 90
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 126, (experts, rows, groups), dtype=torch.uint8, generator=g)
    out_bytes = blocks.numel() * 2 * 2  # two bf16 values per byte
    for e in range(0, experts, 16):  # identical bits, on every 16th expert (the check is not timed)
        new, old = mxfp4.decode(blocks[e], scales[e]), decode_before_issue_16(blocks[e], scales[e])
        assert torch.equal(new.view(torch.int16), old.view(torch.int16)), f"expert {e}: decoders differ"
    cores, workers = len(os.sched_getaffinity(0)), worker_count()
    default_threads = torch.get_num_threads()

    def one_by_one(fn, threads: int):
        torch.set_num_threads(threads)
        for e in range(experts):
            fn(blocks[e], scales[e])

    def spread(pool):
        torch.set_num_threads(1)  # as convert runs it: one torch thread per worker
        for _ in pool.map(lambda e: mxfp4.decode(blocks[e], scales[e]), range(experts)):
            pass  # each result dropped as it comes, as convert writes and drops each expert

    before_default = f"before issue 16, torch threads {default_threads} (as convert ran it)"
    before_one = "before issue 16, torch threads 1"
    pools = {n: ThreadPoolExecutor(n) for n in sorted({cores, workers}) if n > 1}
    cases = {before_default: lambda: one_by_one(decode_before_issue_16, default_threads)}
    if default_threads != 1:
        cases[before_one] = lambda: one_by_one(decode_before_issue_16, 1)
    cases["now, 1 thread"] = lambda: one_by_one(mxfp4.decode, 1)
    for n, pool in pools.items():
        who = "convert's workers" if n == workers else "all cores"
        cases[f"now, {n} Python threads ({who})"] = partial(spread, pool)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):  # interleaved rounds: a burst of load on the machine hits every case
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for pool in pools.values():
        pool.shutdown()
    torch.set_num_threads(default_threads)
    base_default = statistics.median(times[before_default])
    base_one = statistics.median(times.get(before_one, times[before_default]))
    print(f"decode of one expert stack ({experts} x {rows} x {groups} x 16 bytes -> {out_bytes / 1e9:.2f} GB bf16, "
          f"expert by expert), median of {rounds}, CPU capability {torch.backends.cpu.get_cpu_capability()}:")
    print(f"  {'':55s} {'s':>6s}  {'GB/s':>6s}  {'vs as-ran':>9s}  {'vs 1 thread':>11s}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:55s} {med:6.2f}  {out_bytes / med / 1e9:6.2f}  {base_default / med:8.2f}x  {base_one / med:10.2f}x")
    print(flush=True)


# --- the conversion benchmark ----------------------------------------------------------------
def write_synthetic(folder: Path, blocks: int, vocab: int) -> int:
    """An HF MXFP4 checkpoint of `blocks` 120B blocks, written piece by piece (no tensor held whole)."""
    arch = preset("gpt_oss_120b").replace(num_hidden_layers=blocks, vocab_size=vocab)
    jobs = plan_to_hf(arch, HF_MXFP4, torch.bfloat16)
    plan = [s for j in jobs for s in j.outputs]
    folder.mkdir(parents=True)
    writer = ShardedWriter(folder, plan, max_shard_bytes=4 * 10**9)
    g = torch.Generator().manual_seed(0)
    for spec in plan:
        rows = spec.shape[0] if spec.shape else 1
        step = max(1, (64 << 20) // max(1, spec.row_bytes))
        for r0 in range(0, rows, step):
            shape = (min(rows, r0 + step) - r0, *spec.shape[1:])
            if spec.dtype == torch.uint8 and spec.name.endswith("_scales"):
                t = torch.randint(118, 126, shape, dtype=torch.uint8, generator=g)
            elif spec.dtype == torch.uint8:
                t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
            else:
                t = (torch.randn(shape, generator=g) * 0.02).to(spec.dtype)
            writer.write(spec.name, t)
    writer.close()
    (folder / "config.json").write_text(json.dumps(to_hf_config(arch, experts_form="mxfp4")))
    assert len(units(arch)) > 0
    return writer.bytes_written


def convert_in_subprocess(src: Path, dst: Path) -> dict:
    summary = dst.with_suffix(".json")
    cmd = [sys.executable, "-m", "gptoss_cli", "convert", str(src), str(dst), "--quiet", "--json", str(summary)]
    subprocess.run(cmd, check=True)
    return json.loads(summary.read_text())


def read_through(path: Path, chunk: int = 64 << 20) -> None:
    """Read a file once so that its pages are in the page cache."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        while f.readinto(buf):
            pass


def fsync_files(paths) -> None:
    """Flush these files' data to disk (not the whole system's, as `sync` would: on a shared host
    other jobs' dirty pages would land in whichever timing ran the sync)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def plain_copy_seconds(folder: Path, dst: Path) -> float:
    """Copy the output folder file by file (copy + sync timed), deleting each copy before the next
    so that the baseline needs one shard of extra disk, not a second model.

    Each file is read once before its copy is timed: convert reads a source that is in the page
    cache (just written by `write_synthetic`), so the copy gets a cached source too, not one that
    writing and syncing may have pushed out of memory."""
    dst.mkdir()
    total = 0.0
    for f in sorted(folder.iterdir()):
        subprocess.run(["sync"], check=False)
        read_through(f)
        t0 = time.perf_counter()
        shutil.copyfile(f, dst / f.name)
        fsync_files([dst / f.name])
        total += time.perf_counter() - t0
        (dst / f.name).unlink()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-rounds", type=int, default=5, help="rounds of the decode micro-benchmark (0: skip)")
    ap.add_argument("--vocab", type=int, default=201088, help="vocabulary rows (real: 201088)")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    keep_freed_memory()  # as `gptoss convert` does: the micro-benchmark's buffers come from the heap
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{len(os.sched_getaffinity(0))} cores, convert workers {worker_count()}, load average "
          f"{os.getloadavg()[0]:.1f} at start\n", flush=True)
    if args.decode_rounds:
        decode_microbench(args.decode_rounds)
    if not args.blocks:
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gptoss-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for blocks in args.blocks:
        src = work / f"src{blocks}"
        shutil.rmtree(src, ignore_errors=True)
        src_bytes = write_synthetic(src, blocks, args.vocab)
        conv_s, copy_s, rss, read_r, dec_r, write_r, shares = [], [], [], [], [], [], []
        out_bytes = workers = 0
        for r in range(args.repeats):
            dst = work / f"dst{blocks}"
            shutil.rmtree(dst, ignore_errors=True)
            subprocess.run(["sync"], check=False)  # start both timings with no dirty pages pending
            summary = convert_in_subprocess(src, dst)
            t0 = time.perf_counter()
            fsync_files(sorted(dst.iterdir()))
            sync_s = time.perf_counter() - t0
            # time inside convert() (not the interpreter start-up) plus flushing its output to disk
            seconds = summary["seconds"] + sync_s
            conv_s.append(seconds)
            rss.append(summary["peak_rss_bytes"])
            out_bytes, workers = summary["bytes_written"], summary["workers"]
            read_r.append(summary["read_bytes"] / summary["read_seconds"])
            dec_r.append(out_bytes / summary["transform_seconds"])
            write_r.append(out_bytes / (summary["write_seconds"] + sync_s))
            # busy share of each stage: its busy time over the time its threads had
            shares.append({
                "read": summary["read_seconds"] / (seconds * workers),
                "decode": summary["transform_seconds"] / (seconds * workers),
                "write": (summary["write_seconds"] + sync_s) / seconds,
            })
            copy_dst = work / f"copy{blocks}"
            shutil.rmtree(copy_dst, ignore_errors=True)
            copy_s.append(plain_copy_seconds(dst, copy_dst))
            shutil.rmtree(copy_dst)
            print(f"  blocks={blocks} repeat {r + 1}: convert {seconds:.1f} s, copy {copy_s[-1]:.1f} s, "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
        shutil.rmtree(work / f"dst{blocks}", ignore_errors=True)
        shutil.rmtree(src)
        conv_bps = out_bytes / statistics.median(conv_s)
        copy_bps = out_bytes / statistics.median(copy_s)
        share = {k: statistics.median(s[k] for s in shares) for k in ("read", "decode", "write")}
        bound = max(share, key=share.get)
        row = (blocks, out_bytes, conv_bps, copy_bps, conv_bps / copy_bps, max(rss), statistics.median(read_r),
               statistics.median(dec_r), statistics.median(write_r), workers, f"{bound} ({share[bound]:.0%} busy)")
        rows.append(row)
        print(
            f"blocks={blocks} src={src_bytes / 1e9:.2f} GB out={out_bytes / 1e9:.2f} GB "
            f"convert={conv_bps / 1e9:.2f} GB/s (median of {args.repeats}, incl. sync) "
            f"copy={copy_bps / 1e9:.2f} GB/s ratio={conv_bps / copy_bps:.2f} peak_rss={max(rss) / 2**30:.2f} GiB "
            f"busy shares: " + ", ".join(f"{k} {v:.0%}" for k, v in share.items()),
            flush=True,
        )
    print("\nblocks  out_GB  convert_GB/s  copy_GB/s  ratio  peak_RSS_GiB  read_GB/s  decode_GB/s  write_GB/s"
          "  workers  bound")
    for b, o, c, p, ratio, rss, rd, dc, wr, w, bound in rows:
        print(f"{b:6d}  {o / 1e9:6.2f}  {c / 1e9:12.2f}  {p / 1e9:9.2f}  {ratio:5.2f}  {rss / 2**30:12.2f}"
              f"  {rd / 1e9:9.2f}  {dc / 1e9:11.2f}  {wr / 1e9:10.2f}  {w:7d}  {bound}")
    print("read/decode GB/s: per worker thread (source bytes read, output bytes produced per busy second);"
          " write GB/s: output bytes per second of the writer's file I/O plus the final sync.\n"
          "bound: the stage whose threads were busiest (read and decode run on the workers, writing on"
          " one thread); near 100% it limits the run.")
    flat = max(r[5] for r in rows) / min(r[5] for r in rows)
    print(f"peak RSS max/min across block counts: {flat:.2f} (flat = 1.0); targets: ratio >= 0.8, RSS < 4 GiB")


if __name__ == "__main__":
    main()
