"""Measure `gptoss train`'s host memory on the CPU recipes against validate-config's estimate, per vocabulary.

For each recipe and vocabulary, `gptoss train` runs as a user would run it (its own processes,
its own allocator setting) while this script polls every worker's /proc status: the peak resident
set (VmHWM, exact), and the resident set over the run, to see whether it keeps growing (the RSS in
the first and last quarter of the run's samples). The estimate is validate-config's per-process
memory (`recipe.estimate.memory`, the same recipe and overrides); it counts the tensors a step holds, not
the runtime every process carries (torch's libraries, gloo), which is measured apart: the RSS of
a process that imported what a worker imports (`runtime`). So `peak - runtime` is what the
estimate should match.

    python bench/memory.py                                   # tiny_cpu_ep2 at vocab 1003, 32768, 201088
    python bench/memory.py --vocab 201088 --iters 80         # the user's run from issue 41
    python bench/memory.py --allocator keep --vocab 201088   # glibc keeping freed memory, as train used to

`--allocator keep` gives the workers glibc's tunables for what `resources.keep_freed_memory` sets
(GLIBC_TUNABLES mmap_threshold 1 GiB, trim_threshold 2 GiB), to show what that setting did.

Each worker's kernel account is read from /proc/<pid>/stat with its resident set: user and system
CPU seconds and minor page faults per step, between the end of the first step (metrics.jsonl's
first line) and the last sample, divided by the steps between. `--before` runs every case twice,
the second time as `gptoss train` ran before issue 55 (the LM head's buffers fresh per chunk, the
heap handed back after every step: GPTOSS_LM_HEAD_BUFFERS=fresh, GPTOSS_HEAP_RELEASE_GROWTH=0), and
prints peak RSS, system / user time and faults per step side by side.

    python bench/memory.py --vocab 201088 --before           # issue 55: the three, before and after

Prints the load average during the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench import harness  # noqa: E402

KEEP_TUNABLES = "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=2147483648"
# --allocator tunables=STRING: any other GLIBC_TUNABLES for the workers (e.g. a fixed mmap threshold)
TUNABLES_PREFIX = "tunables="


def allocator_tunables(allocator: str) -> str | None:
    """The GLIBC_TUNABLES the workers get for an --allocator value (None: glibc's defaults)."""
    if allocator == "keep":
        return KEEP_TUNABLES
    if allocator.startswith(TUNABLES_PREFIX):
        return allocator[len(TUNABLES_PREFIX):]
    return None
GB = 1e9


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        for c in children.get(pid, []):
            found.append(c)
            todo.append(c)
    return found


TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[float, float, int] | None:
    """(user s, system s, minor faults) of a process from /proc/<pid>/stat."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) / TICK, int(fields[12]) / TICK, int(fields[7])
    except (OSError, ValueError, IndexError):
        return None


def _steps_done(metrics: Path | None, nproc: int) -> int:
    try:
        return len(metrics.read_text().splitlines()) // max(1, nproc) if metrics else 0
    except OSError:
        return 0


class RssWatch:
    """Polls the resident set of a process tree: per pid, the peak (VmHWM) and the RSS samples; and each
    pid's (steps done, user s, system s, minor faults), the steps read from the run's metrics.jsonl."""

    def __init__(self, root: int, interval: float = 0.25, metrics: Path | None = None, nproc: int = 1):
        self.root, self.interval, self.metrics, self.nproc = root, interval, metrics, nproc
        self.peak: dict[int, int] = {}
        self.samples: dict[int, list[int]] = {}
        self.kernel: dict[int, list[tuple[int, float, float, int]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            steps = _steps_done(self.metrics, self.nproc)
            for pid in [self.root, *_descendants(self.root)]:
                st, counters = _status(pid), _stat(pid)
                if "VmHWM" in st:
                    self.peak[pid] = max(self.peak.get(pid, 0), st["VmHWM"])
                    self.samples.setdefault(pid, []).append(st["VmRSS"])
                if counters is not None:
                    self.kernel.setdefault(pid, []).append((steps, *counters))
            self._stop.wait(self.interval)

    def per_step(self, pid: int) -> dict[str, float] | None:
        """User s, system s and minor faults per step of `pid` between the first sample after its first
        step and its last sample (None: too few steps seen)."""
        seen = [k for k in self.kernel.get(pid, []) if k[0] >= 1]
        if len(seen) < 2 or seen[-1][0] <= seen[0][0]:
            return None
        last = next(k for k in seen if k[0] == seen[-1][0])  # the end of the last step, not the exit after it
        (s0, u0, y0, f0), (s1, u1, y1, f1) = seen[0], last
        n = s1 - s0
        return {"user_s": (u1 - u0) / n, "system_s": (y1 - y0) / n, "minor_faults": (f1 - f0) / n}

    def start(self) -> "RssWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def workers(self) -> list[int]:
        """The processes that trained: the biggest peaks (the launcher and the elastic agent hold no model)."""
        return sorted(self.peak, key=lambda p: -self.peak[p])


def runtime_rss(threads: int) -> int:
    """RSS of a process that imported what a training worker imports (torch, torch.distributed, the loop)."""
    code = ("import torch, torch.distributed, gptoss_cli.train.loop, gptoss_cli.run.launch\n"
            "from gptoss_cli.resources import peak_rss_bytes\n"
            "import pathlib; print([int(l.split()[1]) * 1024 for l in pathlib.Path('/proc/self/status')"
            ".read_text().splitlines() if l.startswith('VmRSS')][0])")
    out = subprocess.run([sys.executable, "-c", code], env=harness.peer_env(threads), capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return int(out.stdout.strip().splitlines()[-1])


def estimate_bytes(recipe: str, overrides: list[str]) -> float:
    from gptoss_cli.recipe import load_and_validate

    _, report = load_and_validate(recipe, overrides)
    if report.memory is None:
        raise SystemExit(f"bench: no memory estimate for {recipe} {' '.join(overrides)}")
    return report.memory.total_bytes


# How `gptoss train` ran before issue 55 (--before): the LM head's buffers fresh, the heap handed back every step.
BEFORE_ENV = {"GPTOSS_LM_HEAD_BUFFERS": "fresh", "GPTOSS_HEAP_RELEASE_GROWTH": "0"}


def measure(recipe: str, vocab: int, args, workdir: Path, before: bool = False) -> dict:
    run_dir = workdir / f"{recipe}-{vocab}{'-before' if before else ''}"
    overrides = [f"model.architecture.vocab_size={vocab}", f"training.seq_length={args.seq}",
                 f"training.train_iters={args.iters}", "checkpoint.dir=null", "checkpoint.save_interval=null",
                 f"logging.run_dir={run_dir}", *args.override]
    tunables = allocator_tunables(args.allocator)
    env = harness.peer_env(args.threads, {"GLIBC_TUNABLES": tunables} if tunables else None)
    env.update(BEFORE_ENV if before else {})
    env["COLUMNS"] = "200"
    cmd = [sys.executable, "-m", "gptoss_cli", "train", "--recipe", recipe, *overrides]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch = RssWatch(proc.pid, metrics=run_dir / "metrics.jsonl", nproc=args.nproc).start()
    out, _ = proc.communicate()
    watch.stop()
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-5:])
        raise SystemExit(f"bench: `{' '.join(cmd[2:])}` exited {proc.returncode}:\n{tail}")
    est = estimate_bytes(recipe, overrides)
    rows = []
    for pid in watch.workers()[:args.nproc]:
        s = watch.samples[pid]
        q = max(1, len(s) // 4)
        rows.append({"pid": pid, "peak_rss": watch.peak[pid], "rss_first_quarter_max": max(s[:q]),
                     "rss_last_quarter_max": max(s[-q:]), "per_step": watch.per_step(pid)})
    return {"recipe": recipe, "vocab": vocab, "before": before, "seq": args.seq, "iters": args.iters,
            "seconds": seconds,
            "estimate": est, "workers": rows, "command": "gptoss train --recipe " + recipe + " " + " ".join(overrides)}


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--recipes", nargs="+", default=["tiny_cpu_ep2"])
    ap.add_argument("--vocab", nargs="+", type=int, default=[1003, 32768, 201088])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=2, help="workers per run (the recipes' world size)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every worker")
    ap.add_argument("--allocator", default="train",
                    help="train: as `gptoss train` runs; keep: glibc keeping freed memory; tunables=STRING: "
                         "these GLIBC_TUNABLES for the workers")
    ap.add_argument("--override", nargs="*", default=[], help="more recipe overrides for every run")
    ap.add_argument("--before", action="store_true",
                    help="run every case a second time as gptoss train ran before issue 55 (fresh LM-head buffers, "
                         "the heap handed back after every step)")
    args = ap.parse_args()
    if args.allocator not in ("train", "keep") and not args.allocator.startswith(TUNABLES_PREFIX):
        ap.error(f"--allocator {args.allocator}: train, keep or tunables=STRING")
    runtime = runtime_rss(args.threads)
    results = []
    with harness.Run("memory", args, clock="wall") as run, \
            tempfile.TemporaryDirectory(prefix="gptoss-bench-memory-") as tmp:
        for recipe in args.recipes:
            for vocab in args.vocab:
                for before in (False, True) if args.before else (False,):
                    results.append(measure(recipe, vocab, args, Path(tmp), before))
                    r = results[-1]
                    print(f"{recipe} vocab {vocab}{' (before issue 55)' if before else ''}: {r['seconds']:.0f} s",
                          flush=True)
    befores, results = [r for r in results if r["before"]], [r for r in results if not r["before"]]
    alloc = ("as gptoss train runs" if args.allocator == "train"
             else f"GLIBC_TUNABLES={allocator_tunables(args.allocator)}")
    print(f"\nseq {args.seq}, {args.iters} steps, allocator: {alloc}, {args.threads} thread(s) per worker; "
          f"runtime (torch + gptoss imported, no model): {runtime / GB:.2f} GB")
    print("per run, the worker with the highest peak; delta: over the recipe's smallest vocabulary (its fixed cost)")
    print(f"{'recipe':<22} {'vocab':>7} {'estimate':>9} {'peak RSS':>9} {'peak-runtime':>13} {'d peak':>8} "
          f"{'d estimate':>11} {'d ratio':>8} {'RSS 1st quarter':>16} {'RSS last quarter':>17}")
    for r in results:
        worst = max(r["workers"], key=lambda w: w["peak_rss"])
        base = min((b for b in results if b["recipe"] == r["recipe"]), key=lambda b: b["vocab"])
        base_peak = max(w["peak_rss"] for w in base["workers"])
        d_peak, d_est = worst["peak_rss"] - base_peak, r["estimate"] - base["estimate"]
        r.update(delta_peak=d_peak, delta_estimate=d_est)
        case = f"{r['recipe']} vocab {r['vocab']}"
        run.add(case, "gptoss train", "peak_rss_gb", worst["peak_rss"] / GB)
        run.add(case, "gptoss train", "rss_first_quarter_gb", worst["rss_first_quarter_max"] / GB)
        run.add(case, "gptoss train", "rss_last_quarter_gb", worst["rss_last_quarter_max"] / GB)
        run.add(case, "gptoss train", "run_s", r["seconds"])
        run.add(case, "validate-config estimate", "peak_rss_gb", r["estimate"] / GB)
        run.ratio(case, "gptoss train", "validate-config estimate", "peak_rss_gb",
                  name="(peak - runtime) / estimate", values=[(worst["peak_rss"] - runtime) / r["estimate"]])
        ratio = f"{d_peak / d_est:7.2f}x" if d_est > 0 else f"{'-':>8}"
        print(f"{r['recipe']:<22} {r['vocab']:>7} {r['estimate'] / GB:>8.2f}G {worst['peak_rss'] / GB:>8.2f}G "
              f"{(worst['peak_rss'] - runtime) / GB:>12.2f}G {d_peak / GB:>7.2f}G {d_est / GB:>10.2f}G {ratio} "
              f"{worst['rss_first_quarter_max'] / GB:>15.2f}G {worst['rss_last_quarter_max'] / GB:>16.2f}G")
    print_kernel_table(run, results, befores)
    run.extra.update(runtime_rss=runtime, allocator=args.allocator, runs=results + befores)
    run.finish()
    return 0


def print_kernel_table(run: harness.Run, results: list[dict], befores: list[dict]) -> None:
    """Per run, the worker with the highest peak: peak RSS, user and system seconds and minor faults per step."""
    print("\nthe kernel's share, per step of the worker with the highest peak (between the ends of the first and "
          "last steps):")
    print(f"{'recipe':<22} {'vocab':>7} {'as':<18} {'peak RSS':>9} {'user s':>8} {'system s':>9} {'sys/user':>9} "
          f"{'minor faults':>13}")
    for r in [x for pair in zip(results, befores) for x in pair] if befores else results:
        worst = max(r["workers"], key=lambda w: w["peak_rss"])
        k, side = worst["per_step"], "before issue 55" if r["before"] else "gptoss train"
        case = f"{r['recipe']} vocab {r['vocab']}"
        run.add(case, side, "peak_rss_gb", worst["peak_rss"] / GB)
        if k is None:
            print(f"{r['recipe']:<22} {r['vocab']:>7} {side:<18} {worst['peak_rss'] / GB:>8.2f}G  (too few steps seen)")
            continue
        for metric in ("user_s", "system_s", "minor_faults"):
            run.add(case, side, f"{metric}_per_step" if metric != "minor_faults" else "minor_faults_per_step",
                    k[metric])
        share = k["system_s"] / k["user_s"] if k["user_s"] else float("nan")
        print(f"{r['recipe']:<22} {r['vocab']:>7} {side:<18} {worst['peak_rss'] / GB:>8.2f}G {k['user_s']:>8.3f} "
              f"{k['system_s']:>9.3f} {100 * share:>8.1f}% {k['minor_faults']:>13.0f}")


if __name__ == "__main__":
    sys.exit(main())
