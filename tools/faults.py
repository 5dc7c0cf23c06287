"""Random kill -9 through `gptoss convert` and through a training run with checkpoint saves.

Convert: a previous output (fp32) sits at DST; `gptoss convert SRC DST --force --dtype bfloat16`
is killed with SIGKILL at a uniformly random moment of its run (startup included). Afterwards DST
must be byte-identical to the previous output or to a complete new one (never absent, never
partial); then the same command is run again and must leave DST complete and nothing else behind.

Train: `gptoss train` on 2 processes (EP=2) saving every step is killed with SIGKILL to its whole
process group (a node losing power) at a random moment after its first checkpoint. Afterwards
`latest` must point at a complete checkpoint (train_state.json, DCP metadata, every shard file at
least as long as the metadata says); then a resumed run must succeed, taking over the dead run's
lock and removing what it left.

Prints, per part: trials, how often DST / `latest` was incomplete (must be 0), how often
something was left behind right after the kill, what was left after the next run (must be 0),
and failed next runs (must be 0).

    python tools/faults.py --n 20 --workdir /tmp/gptoss-faults
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

TEMP_MARKERS = (".partial", ".old-", ".tmp")


def gptoss(*args: object) -> list[str]:
    return [sys.executable, "-m", "gptoss_cli", *map(str, args)]


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and any(m in p.name for m in TEMP_MARKERS))


def digest(folder: Path) -> dict[str, str]:
    """Content of every file except hybrid_config.json's creation time (two runs differ only there)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        if p.name == "hybrid_config.json":
            cfg = json.loads(data)
            cfg.get("provenance", {}).pop("created", None)
            data = json.dumps(cfg, sort_keys=True).encode()
        out[str(p.relative_to(folder))] = hashlib.sha256(data).hexdigest()
    return out


def run_ok(cmd: list[str], what: str) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed: {proc.stderr[-2000:]}")
    return time.monotonic() - t0


def timed_write_window(cmd: list[str], dst: Path) -> tuple[float, float]:
    """Run `cmd` to completion; (seconds until its temporary folder appeared, total seconds)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    appeared = None
    while proc.poll() is None:
        if appeared is None and any(dst.parent.glob(f".{dst.name}.partial-{proc.pid}")):
            appeared = time.monotonic() - t0
        time.sleep(0.001)
    total = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"reference conversion failed: {proc.stderr.read()[-2000:]}")
    return (appeared if appeared is not None else 0.0), total


def kill_at(cmd: list[str], delay: float, group: bool = False,
            after: tuple[Path, str] | None = None) -> tuple[int | None, float]:
    """Start `cmd`, SIGKILL it (or its process group) after `delay` s; (exit code or None if killed, delay).

    after=(dst, marker): the delay counts from when `.DST<marker><pid>` appears next to dst.
    """
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    if after is not None:
        dst, marker = after
        while proc.poll() is None and not any(dst.parent.glob(f".{dst.name}{marker}{proc.pid}")):
            time.sleep(0.0005)
    try:
        proc.wait(timeout=delay)
        return proc.returncode, delay
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill()
        proc.wait()
        return None, delay


# --- convert -------------------------------------------------------------------------------------
def bench_convert(n: int, work: Path, rng: random.Random) -> dict:
    from gptoss_cli.checkpoint.make_tiny import make_tiny
    from gptoss_cli.model.config import preset

    # Big enough that writing takes a visible share of the run, small enough for many trials.
    arch = preset("tiny").replace(hidden_size=512, intermediate_size=512, num_local_experts=8, num_attention_heads=8,
                                  num_key_value_heads=2, head_dim=64, vocab_size=32003)
    src, old_ref, new_ref, dst = work / "src", work / "old", work / "new", work / "out" / "dst"
    for p in (src, old_ref, new_ref, dst.parent):
        shutil.rmtree(p, ignore_errors=True)
    make_tiny(src, arch=arch, experts="mxfp4")
    run_ok(gptoss("convert", src, old_ref, "--dtype", "float32", "--quiet"), "reference (old) conversion")
    write_starts, full = timed_write_window(gptoss("convert", src, new_ref, "--dtype", "bfloat16", "--quiet"), new_ref)
    old, new = digest(old_ref), digest(new_ref)
    dst.parent.mkdir(parents=True)

    stats = {"trials": n, "dst_incomplete": 0, "dst_old": 0, "dst_new": 0, "killed": 0, "left_after_kill": 0,
             "left_after_next_run": 0, "next_run_failed": 0, "run_seconds": round(full, 2),
             "write_window": (round(write_starts, 2), round(full, 2)), "left_kinds": {}}
    for i in range(n):
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(old_ref, dst)
        # Half the kills anywhere in the run, half at a random moment after the temporary folder
        # appeared (most of a run is start-up and reading, where a kill can leave nothing behind).
        cmd = gptoss("convert", src, dst, "--force", "--dtype", "bfloat16", "--quiet")
        if i % 2:
            code, _ = kill_at(cmd, rng.uniform(0, full))
        else:
            code, _ = kill_at(cmd, rng.uniform(0, full - write_starts), after=(dst, ".partial-"))
        stats["killed"] += code is None
        state = digest(dst) if dst.is_dir() else None
        if state == old:
            stats["dst_old"] += 1
        elif state == new:
            stats["dst_new"] += 1
        else:
            stats["dst_incomplete"] += 1
        left = leftovers(dst.parent)
        stats["left_after_kill"] += bool(left)
        for name in left:
            kind = name.rsplit("-", 1)[0].rsplit(".", 1)[-1]
            stats["left_kinds"][kind] = stats["left_kinds"].get(kind, 0) + 1
        proc = subprocess.run(gptoss("convert", src, dst, "--force", "--dtype", "bfloat16", "--quiet"), env=env(),
                              capture_output=True, text=True)
        stats["next_run_failed"] += proc.returncode != 0 or digest(dst) != new
        stats["left_after_next_run"] += len(leftovers(dst.parent))
    return stats


# --- train ---------------------------------------------------------------------------------------
def complete_checkpoint(ckpt: Path) -> bool:
    """`latest` names a folder whose metadata, train state and every shard byte range are present."""
    import torch.distributed.checkpoint as dcp

    try:
        folder = ckpt / (ckpt / "latest").read_text().strip()
        json.loads((folder / "train_state.json").read_text())
        meta = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception:
        return False
    for info in meta.storage_data.values():
        path = folder / info.relative_path
        if not path.is_file() or path.stat().st_size < info.offset + info.length:
            return False
    return True


def bench_train(n: int, work: Path, rng: random.Random) -> dict:
    ckpt, run = work / "ckpt", work / "run"
    base = ["train", "--recipe", "tiny_cpu_ep2", f"checkpoint.dir={ckpt}", f"logging.run_dir={run}",
            "training.seq_length=16", "training.global_batch_size=4", "precision.params_dtype=fp32",
            "training.warmup_iters=0", "checkpoint.save_interval=1", "-q"]
    stats = {"trials": n, "latest_incomplete": 0, "no_checkpoint_yet": 0, "left_after_kill": 0,
             "left_after_next_run": 0, "next_run_failed": 0}
    for _ in range(n):
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)
        proc = subprocess.Popen(gptoss(*base, "training.train_iters=100000"), env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 300
        while not (ckpt / "latest").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        # Then a random moment within the next few steps (each step saves: many kills land mid-save).
        time.sleep(rng.uniform(0, 2.0))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(0.5)  # let the kernel reap the group
        if not (ckpt / "latest").exists():
            stats["no_checkpoint_yet"] += 1
        elif not complete_checkpoint(ckpt):
            stats["latest_incomplete"] += 1
        stats["left_after_kill"] += bool(leftovers(ckpt))
        step = int((ckpt / "latest").read_text().strip().split("_")[1]) if (ckpt / "latest").exists() else 0
        nxt = subprocess.run(gptoss(*base, f"training.train_iters={step + 1}"), env=env(), capture_output=True,
                             text=True)
        stats["next_run_failed"] += nxt.returncode != 0 or not complete_checkpoint(ckpt)
        stats["left_after_next_run"] += len(leftovers(ckpt))
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20, help="kills per part")
    ap.add_argument("--parts", nargs="+", default=["convert", "train"], choices=["convert", "train"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gptoss-faults"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if "convert" in args.parts:
        s = bench_convert(args.n, args.workdir / "convert", rng)
        print(f"convert: {s['trials']} random kill -9 ({s['killed']} landed before the run ended; one run "
              f"{s['run_seconds']} s, writing from {s['write_window'][0]} s): DST incomplete or absent {s['dst_incomplete']} (must be 0); DST was the old "
              f"output {s['dst_old']}x, the new one {s['dst_new']}x; something left next to DST after the kill "
              f"{s['left_after_kill']}x {s['left_kinds']}; left after the next run {s['left_after_next_run']} "
              f"(must be 0); next run failed {s['next_run_failed']} (must be 0)", flush=True)
    if "train" in args.parts:
        s = bench_train(args.n, args.workdir / "train", rng)
        print(f"train: {s['trials']} random kill -9 of the job after its first checkpoint: latest incomplete "
              f"{s['latest_incomplete']} (must be 0), no checkpoint yet {s['no_checkpoint_yet']}; something left "
              f"in checkpoint.dir after the kill {s['left_after_kill']}x; left after the resumed run "
              f"{s['left_after_next_run']} (must be 0); resumed run failed {s['next_run_failed']} (must be 0)",
              flush=True)


if __name__ == "__main__":
    main()
