"""Time each command's start-up as a user meets it: a fresh process, its time to first output and to exit,
against `python -c "import torch"` (what any command that computes must pay) and an empty interpreter.

Every round runs each command once, in an order that rotates by one each round; per command the
bench prints the medians and the spread of: wall seconds to the first byte on stdout or stderr,
wall seconds to exit, and the CPU seconds the process used (user + system, from wait4: on a loaded
host the part of the wall time that is this command's own work). It also says which heavy
packages each command imported (run once more with `-X importtime`): torch, omegaconf,
transformers, numpy, safetensors.

    python bench/startup.py --rounds 7
    python bench/startup.py --commands help validate    # a subset

`convert` converts a `gptoss make-tiny` checkpoint (made once, untimed) into a new folder each
round: its total is the whole process a user waits for, start-up included.
"""

from __future__ import annotations

import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench import harness  # noqa: E402

HEAVY = ("torch", "omegaconf", "transformers", "numpy", "safetensors")


def gptoss_cmd() -> list[str]:
    """The console script next to this interpreter (what `pip install` puts on PATH), else `-m gptoss_cli`."""
    script = Path(sys.executable).parent / "gptoss"
    return [str(script)] if script.exists() else [sys.executable, "-m", "gptoss_cli"]


def commands(work: Path) -> dict[str, list[str] | None]:
    g = gptoss_cmd()
    return {
        "python (empty)": [sys.executable, "-c", "pass"],
        "import torch": [sys.executable, "-c", "import torch"],
        "help": [*g, "--help"],
        "validate": [*g, "validate-config", "tiny_cpu_ep2"],
        "convert": [*g, "convert", str(work / "tiny"), str(work / "out"), "--force"],
    }


def run_once(cmd: list[str], cwd: Path, env: dict) -> dict:
    """(first output s, total s, CPU s) of one run; the command must succeed (validate-config may exit 1)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    first, open_streams, err = None, 2, b""
    while open_streams:
        for key, _ in sel.select():
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            if first is None:
                first = time.perf_counter() - t0
            if key.fileobj is proc.stderr:
                err += chunk
    _, status, usage = os.wait4(proc.pid, 0)
    total = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"bench: {' '.join(cmd)} exited {proc.returncode}: {err.decode(errors='replace')[-500:]}")
    return {"first_output_s": first if first is not None else total, "total_s": total,
            "cpu_s": usage.ru_utime + usage.ru_stime}


def imported(cmd: list[str], cwd: Path, env: dict) -> list[str]:
    """The heavy packages `cmd` imported (a `python -X importtime` run; a console script runs through it too)."""
    argv = [sys.executable, "-X", "importtime", *cmd] if cmd[0] != sys.executable else [cmd[0], "-X", "importtime",
                                                                                          *cmd[1:]]
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    names = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines()
             if line.startswith("import time:")}
    return [h for h in HEAVY if h in names]


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--commands", nargs="+", default=None, help="a subset of: python, torch, help, validate, convert")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    args = ap.parse_args()
    env = harness.peer_env(args.threads, {"COLUMNS": "120"})
    with harness.Run("startup", args, clock="wall") as run, \
            tempfile.TemporaryDirectory(prefix="gptoss-bench-startup-") as tmp:
        work = Path(tmp)
        cmds = commands(work)
        if args.commands:
            keep = {k for k in cmds if any(k.startswith(c) or c in k for c in args.commands)}
            cmds = {k: v for k, v in cmds.items() if k in keep}
        if "convert" in cmds:
            subprocess.run([*gptoss_cmd(), "make-tiny", str(work / "tiny")], cwd=work, env=env, check=True,
                           capture_output=True)

        def side(cmd):
            def once() -> dict:  # the child's own times (its CPU time from wait4), not this process's
                out = run_once(cmd, work, env)
                shutil.rmtree(work / "out", ignore_errors=True)
                return out
            return once

        # the warm-up round fills the page cache with every command's files (not timed)
        rounds = harness.interleave({name: side(cmd) for name, cmd in cmds.items()}, args.rounds, clock="wall")
        heavy = {name: imported(cmd, work, env) for name, cmd in cmds.items()}
    metrics = ("first_output_s", "total_s", "cpu_s")
    run.add_rounds("start-up", rounds, metrics)
    if "import torch" in cmds:
        for name in ("help", "validate"):
            if name in cmds:
                base = rounds["import torch"]["total_s"]
                run.ratio("start-up", name, "import torch", "first_output_s", name=f"{name} first output / import torch",
                          values=[a / b for a, b in zip(rounds[name]["first_output_s"], base)])
    run.extra["commands"] = {name: {"command": " ".join(cmd), "imports": heavy[name]} for name, cmd in cmds.items()}
    print(f"{args.rounds} rounds, rotating order, medians [min, max]; {args.threads} thread(s)")
    print(f"{'command':<16} {'first output (s)':>22} {'exit (s)':>22} {'CPU (s)':>22}  heavy imports")
    for name in cmds:
        cols = [f"{s['median']:6.2f} [{s['min']:5.2f}, {s['max']:5.2f}]"
                for s in (run.cases["start-up"]["settings"][name][k] for k in metrics)]
        print(f"{name:<16} {cols[0]:>22} {cols[1]:>22} {cols[2]:>22}  {', '.join(heavy[name]) or '-'}")
    for label, r in run.cases["start-up"]["ratios"].items():
        print(f"{label}: {r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]")
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
