"""Benchmark `gptoss convert` on a synthetic checkpoint with the real GPT-OSS 120B dimensions.

For 1, 2 and 4 blocks (MXFP4 experts, hidden = intermediate = 2880, 128 experts, 64/8 heads,
vocab 201088) it converts HF -> Hybrid in a fresh process and prints:
  * throughput ratio: output bytes/s of the conversion divided by bytes/s of a plain file copy of
    the same output, timed in the same run (median over --repeats);
  * peak RSS of the converting process (must stay flat as blocks are added).
Targets (issue 2): ratio >= 0.5, peak RSS < 4 GiB.

    python bench/convert.py --blocks 1 2 4 --repeats 3 --workdir /tmp/gptoss-bench
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gptoss_cli.checkpoint.layouts import HF_MXFP4
from gptoss_cli.checkpoint.convert import plan_to_hf
from gptoss_cli.checkpoint.safetensors_io import ShardedWriter
from gptoss_cli.checkpoint.mapping import units
from gptoss_cli.model.config import preset


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
    (folder / "config.json").write_text(json.dumps(arch.to_hf_config(experts_form="mxfp4")))
    assert len(units(arch)) > 0
    return writer.bytes_written


def convert_in_subprocess(src: Path, dst: Path) -> dict:
    summary = dst.with_suffix(".json")
    cmd = [sys.executable, "-m", "gptoss_cli", "convert", str(src), str(dst), "--quiet", "--json", str(summary)]
    subprocess.run(cmd, check=True)
    return json.loads(summary.read_text())


def plain_copy_seconds(folder: Path, dst: Path) -> float:
    """Copy the output folder file by file (copy + sync timed), deleting each copy before the next
    so that the baseline needs one shard of extra disk, not a second model."""
    dst.mkdir()
    total = 0.0
    for f in sorted(folder.iterdir()):
        subprocess.run(["sync"], check=False)
        t0 = time.perf_counter()
        shutil.copyfile(f, dst / f.name)
        subprocess.run(["sync"], check=False)
        total += time.perf_counter() - t0
        (dst / f.name).unlink()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=201088, help="vocabulary rows (real: 201088)")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gptoss-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for blocks in args.blocks:
        src = work / f"src{blocks}"
        shutil.rmtree(src, ignore_errors=True)
        src_bytes = write_synthetic(src, blocks, args.vocab)
        conv_s, copy_s, rss, io_share = [], [], [], []
        out_bytes = 0
        for r in range(args.repeats):
            dst = work / f"dst{blocks}"
            shutil.rmtree(dst, ignore_errors=True)
            subprocess.run(["sync"], check=False)  # start both timings with no dirty pages pending
            summary = convert_in_subprocess(src, dst)
            t0 = time.perf_counter()
            subprocess.run(["sync"], check=False)
            # time inside convert() (not the interpreter start-up) plus flushing its output to disk
            conv_s.append(summary["seconds"] + time.perf_counter() - t0)
            rss.append(summary["peak_rss_bytes"])
            io_share.append(summary["write_seconds"] / summary["seconds"])
            out_bytes = summary["bytes_written"]
            copy_dst = work / f"copy{blocks}"
            shutil.rmtree(copy_dst, ignore_errors=True)
            copy_s.append(plain_copy_seconds(dst, copy_dst))
            shutil.rmtree(copy_dst)
        shutil.rmtree(work / f"dst{blocks}", ignore_errors=True)
        shutil.rmtree(src)
        conv_bps = out_bytes / statistics.median(conv_s)
        copy_bps = out_bytes / statistics.median(copy_s)
        rows.append((blocks, src_bytes, out_bytes, conv_bps, copy_bps, conv_bps / copy_bps, max(rss),
                     statistics.median(io_share)))
        print(
            f"blocks={blocks} src={src_bytes / 1e9:.2f} GB out={out_bytes / 1e9:.2f} GB "
            f"convert={conv_bps / 1e9:.2f} GB/s (median of {args.repeats}, incl. sync) "
            f"copy={copy_bps / 1e9:.2f} GB/s ratio={conv_bps / copy_bps:.2f} peak_rss={max(rss) / 2**30:.2f} GiB",
            flush=True,
        )
    print("\nblocks  out_GB  convert_GB/s  copy_GB/s  ratio(convert/copy)  peak_RSS_GiB  write_share")
    for b, _, o, c, p, ratio, rss, share in rows:
        print(f"{b:6d}  {o / 1e9:6.2f}  {c / 1e9:12.2f}  {p / 1e9:9.2f}  {ratio:19.2f}  {rss / 2**30:12.2f}"
              f"  {share:11.2f}")
    print("write_share: time the shard writer spent in file I/O / conversion time (1.0 = disk-bound;"
          " decode and transforms run while the previous chunk is written)")
    flat = max(r[6] for r in rows) / min(r[6] for r in rows)
    print(f"peak RSS max/min across block counts: {flat:.2f} (flat = 1.0); target ratio >= 0.5, RSS < 4 GiB")


if __name__ == "__main__":
    main()
