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

import argparse
import json
import os
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LoadMonitor, peer_env, rotating  # noqa: E402

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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--commands", nargs="+", default=None, help="a subset of: python, torch, help, validate, convert")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    env = peer_env(args.threads, {"COLUMNS": "120"})
    with tempfile.TemporaryDirectory(prefix="gptoss-bench-startup-") as tmp:
        work = Path(tmp)
        cmds = commands(work)
        if args.commands:
            keep = {k for k in cmds if any(k.startswith(c) or c in k for c in args.commands)}
            cmds = {k: v for k, v in cmds.items() if k in keep}
        if "convert" in cmds:
            subprocess.run([*gptoss_cmd(), "make-tiny", str(work / "tiny")], cwd=work, env=env, check=True,
                           capture_output=True)
        times = {name: [] for name in cmds}
        with LoadMonitor() as load:
            for name in cmds:  # warm the page cache of every command's files (not timed)
                run_once(cmds[name], work, env)
            for r in range(args.rounds):
                for name in rotating(list(cmds), r):
                    times[name].append(run_once(cmds[name], work, env))
                    shutil.rmtree(work / "out", ignore_errors=True)
        heavy = {name: imported(cmd, work, env) for name, cmd in cmds.items()}
    print(f"{args.rounds} rounds, rotating order, medians [min, max]; {args.threads} thread(s)")
    print(load.text())
    print(f"{'command':<16} {'first output (s)':>22} {'exit (s)':>22} {'CPU (s)':>22}  heavy imports")
    result = {"rounds": args.rounds, **load.summary(), "commands": {}}
    for name, runs in times.items():
        cols = []
        for key in ("first_output_s", "total_s", "cpu_s"):
            v = [x[key] for x in runs]
            cols.append(f"{statistics.median(v):6.2f} [{min(v):5.2f}, {max(v):5.2f}]")
        print(f"{name:<16} {cols[0]:>22} {cols[1]:>22} {cols[2]:>22}  {', '.join(heavy[name]) or '-'}")
        result["commands"][name] = {"command": " ".join(cmds[name]), "runs": runs, "imports": heavy[name]}
    if "import torch" in times:
        base = statistics.median(x["total_s"] for x in times["import torch"])
        for name in ("help", "validate"):
            if name in times:
                first = statistics.median(x["first_output_s"] for x in times[name])
                print(f"{name}: first output at {first / base:.2f}x the time of `python -c \"import torch\"`")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
