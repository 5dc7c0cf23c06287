"""The one harness every bench runs through: rounds, medians, the host, and the `--json` record.

A bench compares settings (ours and a peer, two kernels, two schedules...) on a host that may be
shared with other jobs. What keeps the comparison fair, and what this module does for every bench:

- **rounds, interleaved**: each round runs every compared setting once (or `steps` times, step by
  step), in an order that rotates by one each round, so a burst of load or a warm cache does not
  always favour the same side (`interleave`);
- **the same clock for both sides**: this process's CPU time (`cpu`, the work of a one-thread run,
  not its waiting) or wall time (`wall`); every measured call also records the kernel's account of
  it: user and system seconds and minor page faults (`getrusage`, the counters /proc/self/stat
  holds), so a side that pays in page faults says so;
- **per-setting medians with min and max**, and **ratios per round** (both sides of a ratio come
  from the same round; the figure is the median of those ratios, with their spread);
- **the host**: the 1-minute load average sampled during the run (`LoadMonitor`), the CPU model
  (`lscpu`'s model name), cores, memory, torch and the accelerator if one is in use;
- **one record** (`Run.record()`), printed in part and written with `--json PATH` in one schema
  (`SCHEMA`): bench name, command line, date, machine, load, the options it ran with, the compared
  settings, per case and setting the metrics' median/min/max/values, the ratios, and anything else
  the bench measured (`extra`). bench/report.py turns the committed records under bench/results/
  into bench/README.md's table of figures.

A record's metrics are named with their unit as suffix (`_s`, `_ms`, `_bytes`, `_gb`, `_per_s`,
`_gbps`, `_tflops`, `_share`...), which bench/report.py uses to print them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "gptoss-bench/1"


# --- the host ---------------------------------------------------------------------------------------
def load_average() -> float:
    """The 1-minute load average (runnable + uninterruptible tasks, averaged by the kernel)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]


class LoadMonitor:
    """Samples the 1-minute load average every `interval` seconds while the `with` block runs;
    `text()` is the line a bench prints: min-max and median over the run, and the CPUs."""

    def __init__(self, interval: float = 2.0):
        self.interval = interval
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(load_average())
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "LoadMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.samples.append(load_average())

    def summary(self) -> dict:
        s = self.samples or [load_average()]
        return {"min": min(s), "median": statistics.median(s), "max": max(s), "cpus": os.cpu_count()}

    def text(self) -> str:
        d = self.summary()
        return (f"load average during the run: {d['min']:.1f}-{d['max']:.1f} "
                f"(median {d['median']:.1f}) on {d['cpus']} CPUs")


def cpu_model() -> str:
    """The CPU's model name as `lscpu` prints it (/proc/cpuinfo, then the platform, where it cannot)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             env=dict(os.environ, LC_ALL="C")).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name" and value.strip():
                return value.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What the figures were measured on: CPU model, cores, memory, Python, torch and its accelerator
    (torch is reported only when the bench imported it: the harness never imports it itself)."""
    try:
        mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal:"))
        memory_gib = round(mem_kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        memory_gib = None
    out = {"cpu": cpu_model(), "cpus": os.cpu_count(), "memory_gib": memory_gib,
           "python": platform.python_version(), "torch": None, "accelerator": None}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.__version__
        out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["accelerator"] = torch.cuda.get_device_name()
    return out


# --- the settings both sides share ---------------------------------------------------------------------
def peer_env(threads: int, extra: dict | None = None) -> dict:
    """The environment a bench gives every process it starts, ours and the peer's alike: the same
    thread count for torch (OMP/MKL) and nothing else changed."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.update(extra or {})
    return env


def allocator_text(kept: bool) -> str:
    """How this process's allocator is set, as a bench prints it."""
    if not kept:
        return "glibc's default allocator"
    from gptoss_cli.resources import ALLOCATOR_SETTING

    return ALLOCATOR_SETTING


# --- clocks and the kernel's account of a call -------------------------------------------------------
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}


def cpu_clock() -> float:
    """This process's CPU time (all its threads): with one torch thread, the work of a step, not its waiting."""
    return time.process_time()


def check_clock(parser: argparse.ArgumentParser, clock: str, threads: int) -> None:
    """Refuse `--clock cpu` with more than one thread (it would add up every thread's time)."""
    if clock == "cpu" and threads != 1:
        parser.error("--clock cpu adds up the CPU time of every thread: use it with --threads 1")


def usage() -> dict[str, float]:
    """This process's kernel counters now: user and system CPU seconds, minor page faults (getrusage:
    the counters /proc/self/stat holds, at microsecond resolution)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"user_s": r.ru_utime, "system_s": r.ru_stime, "minor_faults": float(r.ru_minflt)}


def usage_since(before: Mapping[str, float]) -> dict[str, float]:
    now = usage()
    return {k: now[k] - before[k] for k in now}


def measure(fn: Callable[[], Any], clock: str = "cpu") -> tuple[Any, dict[str, float]]:
    """(fn's result, metrics of the call): `time_s` by `clock` (`cpu`, `wall`, or `cuda`: CUDA events
    around the call), `user_s`, `system_s`, `minor_faults`.
    When fn returns a dict of numbers, those are metrics too and take precedence (a side that times
    only part of its call returns its own `time_s`)."""
    if clock == "cuda":
        return _measure_cuda(fn)
    tick = CLOCKS[clock]
    before = usage()
    t0 = tick()
    out = fn()
    metrics = {"time_s": tick() - t0, **usage_since(before)}
    if isinstance(out, dict):
        metrics.update({k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out, metrics


# A Python command run under this wrapper writes its own peak resident set (VmHWM of its address space, which
# exec starts afresh) to argv[1] at exit. wait4's ru_maxrss cannot be used for it: the kernel keeps, across
# exec, the high-water mark of the address space the child started in, which under vfork (what subprocess
# uses) is the parent's: a bench that built a 19 GB checkpoint reported 19 GB for every process it started.
_PEAK_WRAPPER = """
import atexit, runpy, sys
out = sys.argv[1]
def _peak():
    with open('/proc/self/status') as f, open(out, 'w') as o:
        o.write(next(line for line in f if line.startswith('VmHWM:')).split()[1])
atexit.register(_peak)
args = sys.argv[2:]
if args[0] == '-c':
    sys.argv = ['-c'] + args[2:]
    exec(compile(args[1], '<string>', 'exec'), {'__name__': '__main__'})
elif args[0] == '-m':
    sys.argv = [args[1]] + args[2:]
    runpy.run_module(args[1], run_name='__main__', alter_sys=True)
else:
    sys.argv = args
    sys.path.insert(0, __import__('os').path.dirname(args[0]))
    runpy.run_path(args[0], run_name='__main__')
"""


def run_with_peak(cmd: Sequence[str], peak_file: Path, **popen: Any) -> tuple[int, float, float]:
    """Run the Python command `cmd` ([python, script | -c CODE | -m MODULE, args...]) to its end:
    (exit code, wall seconds, its own peak resident set in bytes; nan when it wrote none, e.g. it was killed)."""
    cmd = list(cmd)
    peak_file.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen([cmd[0], "-c", _PEAK_WRAPPER, str(peak_file), *cmd[1:]], **popen)
    try:
        code = proc.wait()
    except BaseException:  # Ctrl-C or SIGTERM of the bench: no child left behind
        proc.terminate()
        proc.wait()
        raise
    wall = time.perf_counter() - t0
    try:
        peak = float(peak_file.read_text()) * 1024.0
    except (OSError, ValueError):
        peak = float("nan")
    return code, wall, peak


def _measure_cuda(fn: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """`measure` on the GPU: the time between two CUDA events around the call (the device's time)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before = usage()
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    metrics = {"time_s": start.elapsed_time(end) / 1e3, **usage_since(before)}
    if isinstance(out, dict):
        metrics.update({k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out, metrics


# --- rounds ----------------------------------------------------------------------------------------------
def rotating(sides: Sequence, round_index: int) -> list:
    """The sides in the order of round `round_index`: rotated by one each round, so no side always
    runs first (after the other's allocations, or first after a pause in the host's load)."""
    k = round_index % len(sides)
    return list(sides[k:]) + list(sides[:k])


class Rounds:
    """Per setting and metric, one value per round (the median of that round's steps)."""

    def __init__(self, settings: Iterable[str]):
        self.values: dict[str, dict[str, list[float]]] = {s: {} for s in settings}
        self.returned: dict[str, Any] = {}  # each setting's last return value (tokens, losses...)

    def add(self, setting: str, metrics: Mapping[str, float]) -> None:
        for k, v in metrics.items():
            self.values.setdefault(setting, {}).setdefault(k, []).append(float(v))

    def __getitem__(self, setting: str) -> dict[str, list[float]]:
        return self.values[setting]

    def median(self, setting: str, metric: str = "time_s") -> float:
        return statistics.median(self.values[setting][metric])

    def ratios(self, num: str, den: str, metric: str = "time_s") -> list[float]:
        """num's metric over den's, round by round."""
        return [a / b for a, b in zip(self.values[num][metric], self.values[den][metric])]


def interleave(sides: Mapping[str, Callable[[], Any]], rounds: int, *, steps: int = 1, warmup: int = 1,
               clock: str = "cpu", before: Callable[[], None] | None = None) -> Rounds:
    """Run every side `rounds` times, interleaved: `warmup` untimed calls of each first, then per
    round `steps` sub-rounds, each calling every side once in an order that rotates by one at each
    sub-round; a side's value for the round is the median of its `steps` calls (`measure`).
    `before` runs untimed before every call (a barrier, a cache flush)."""
    names = list(sides)
    out = Rounds(names)
    for _ in range(warmup):
        for name in names:
            if before:
                before()
            sides[name]()
    for r in range(rounds):
        per_step: dict[str, list[dict]] = {n: [] for n in names}
        for s in range(steps):
            for name in rotating(names, r * steps + s):
                if before:
                    before()
                out.returned[name], metrics = measure(sides[name], clock)
                per_step[name].append(metrics)
        for name, calls in per_step.items():
            out.add(name, {k: statistics.median(c[k] for c in calls) for k in calls[0]})
    return out


def stats(values: Sequence[float] | float) -> dict:
    """{median, min, max, n, values} of per-round values (a single number: n = 1)."""
    vals = [float(v) for v in (values if isinstance(values, (list, tuple)) else [values])]
    if not vals:
        raise ValueError("no values")
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals), "values": vals}


def median_min_max(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def ratio_text(values: Sequence[float]) -> str:
    med, lo, hi = median_min_max(values)
    return f"{med:.2f}x [{lo:.2f}, {hi:.2f}]"


# --- the record ---------------------------------------------------------------------------------------
def parser(doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """A bench's argument parser: its docstring as the help, and `--json PATH` for the record."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help=f"also write the run's record here ({SCHEMA}; bench/report.py reads it)")
    return p


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and value != value:
        return None  # NaN is not JSON
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and callable(value.item):  # a 0-d tensor or numpy scalar
        return _jsonable(value.item())
    return str(value)


def write_json(path: Path, record: dict) -> None:
    """Write `record` to `path` whole: a temporary name beside it, then a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(_jsonable(record), indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class Run:
    """One run of a bench: the load monitor over it, and the record it leaves.

        with harness.Run("train", args) as run:
            rounds = harness.interleave({"ours": ours, "transformers": hf}, args.rounds)
            run.add_rounds("medium", rounds)
            run.ratio("medium", "transformers", "ours", name="ours / transformers (speed)")
        run.finish()        # prints the load line, writes --json if given
    """

    def __init__(self, bench: str, args: argparse.Namespace | Mapping | None = None, *, clock: str | None = None,
                 load_interval: float = 2.0):
        self.bench = bench
        self.args = args
        self.options = _jsonable(vars(args) if isinstance(args, argparse.Namespace) else dict(args or {}))
        self.options.pop("json", None)
        self.clock = clock or self.options.get("clock")
        self.cases: dict[str, dict] = {}
        self.extra: dict[str, Any] = {}
        self.load = LoadMonitor(load_interval)
        self.date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        self.command = " ".join(["python", _script_path(), *map(shlex.quote, sys.argv[1:])])

    def __enter__(self) -> "Run":
        self.load.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.load.__exit__(*exc)

    def _case(self, case: str) -> dict:
        return self.cases.setdefault(str(case), {"settings": {}, "ratios": {}})

    def add(self, case: str, setting: str, metric: str, values: Sequence[float] | float) -> None:
        """Record `setting`'s `metric` in `case`: per-round values (or one number)."""
        self._case(case)["settings"].setdefault(setting, {})[metric] = stats(values)

    def add_rounds(self, case: str, rounds: Rounds, metrics: Iterable[str] | None = None) -> None:
        """Record every setting's metrics of `rounds` (all of them, or `metrics`) in `case`."""
        for setting, by_metric in rounds.values.items():
            for metric, values in by_metric.items():
                if metrics is None or metric in metrics:
                    self.add(case, setting, metric, values)

    def ratio(self, case: str, num: str, den: str, metric: str = "time_s", *, name: str | None = None,
              values: Sequence[float] | None = None) -> dict:
        """Record num's `metric` over den's, round by round (from what `add` recorded, or `values`
        given per round); its median, min and max, under `name` (default "num / den", and the metric
        unless it is time_s). Returns that entry."""
        if values is None:
            settings = self._case(case)["settings"]
            values = [a / b for a, b in zip(settings[num][metric]["values"], settings[den][metric]["values"])]
        entry = {"num": num, "den": den, "metric": metric, **stats(values)}
        default = f"{num} / {den}" + ("" if metric == "time_s" else f", {metric}")
        self._case(case)["ratios"][name or default] = entry
        return entry

    def settings(self) -> list[str]:
        seen: dict[str, None] = {}
        for c in self.cases.values():
            seen.update(dict.fromkeys(c["settings"]))
        return list(seen)

    def record(self) -> dict:
        return {"schema": SCHEMA, "bench": self.bench, "command": self.command, "date": self.date,
                "source": "measured", "machine": machine(),
                "load": self.load.summary(), "clock": self.clock, "options": self.options,
                "settings": self.settings(), "cases": self.cases, "extra": _jsonable(self.extra)}

    def finish(self, json_path: Path | None = None, *, quiet: bool = False) -> dict:
        """Print the load line; write the record to `json_path` (default: the bench's --json). Returns it."""
        self.__exit__(None, None, None)
        if not quiet:
            print(self.load.text())
        record = self.record()
        path = json_path if json_path is not None else getattr(self.args, "json", None)
        if path:
            write_json(Path(path), record)
        return record


def _script_path() -> str:
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("bench")
    try:
        return script.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return script.as_posix()


__all__ = ["SCHEMA", "LoadMonitor", "load_average", "cpu_model", "machine", "peer_env", "allocator_text",
           "CLOCKS", "cpu_clock", "check_clock", "usage", "usage_since", "measure", "rotating", "Rounds",
           "interleave", "stats", "median_min_max", "ratio_text", "parser", "write_json", "Run"]
