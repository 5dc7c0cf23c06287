"""Fault injection through the real CLI: child processes, signals, tiny tmpfs mounts.

Every fault ends the same way: a known exit code, exactly one line on stderr, no traceback, the
destination either complete or untouched, and no temporary names left next to it.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TRAIN_FAST = ["training.seq_length=16", "training.global_batch_size=4", "precision.params_dtype=fp32",
              "training.warmup_iters=0"]


def child_env(tmp: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="300", PYTHONUNBUFFERED="1")
    if tmp is not None:
        env["TMPDIR"] = str(tmp)  # where the launcher's heartbeat folder goes, so a test can find the ranks
    return env


def gptoss_cmd(*args: object) -> list[str]:
    return [sys.executable, "-m", "gptoss_cli", *map(str, args)]


def gptoss(*args: object, cwd: Path | None = None, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the CLI in a child process, as a user would."""
    return subprocess.run(gptoss_cmd(*args), cwd=cwd, env=env or child_env(), capture_output=True, text=True,
                          timeout=timeout)


def start(*args: object, cwd: Path | None = None, env: dict | None = None) -> subprocess.Popen:
    """Start the CLI in its own session (so a signal can go to its whole process group, as Ctrl-C does)."""
    return subprocess.Popen(gptoss_cmd(*args), cwd=cwd, env=env or child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` and its content hash: 'nothing lost' means this is unchanged."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def assert_one_line(proc: subprocess.CompletedProcess | tuple, code: int, *needles: str, prefix: str = "error:") -> str:
    """Exit `code`, exactly one line on stderr starting with `prefix` and holding every needle, no traceback."""
    returncode, stderr = (proc.returncode, proc.stderr) if not isinstance(proc, tuple) else proc
    assert "Traceback" not in stderr, stderr
    got = lines(stderr)
    assert returncode == code, (returncode, stderr)
    assert len(got) == 1 and got[0].startswith(prefix), stderr
    for needle in needles:
        assert needle in got[0], (needle, got[0])
    return got[0]


def leftovers(folder: Path) -> list[str]:
    """Temporary names gptoss writes next to its outputs (.X.partial-PID, .X.old-PID, .X.tmp-PID, .iter_*.partial)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and
                  any(k in p.name for k in (".partial", ".old-", ".tmp")))


def wait_for(predicate, timeout: float, what: str, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, read_only=False) -> a fresh tmpfs folder; skipped where this process may not mount."""
    mounted: list[Path] = []

    def mount(size: str, read_only: bool = False) -> Path:
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        opts = f"size={size}" + (",ro" if read_only else "")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    """gptoss make-tiny output (MXFP4 experts), written in-process: the source most faults start from."""
    from gptoss_cli.checkpoint.make_tiny import make_tiny

    dst = tmp_path_factory.mktemp("tiny") / "hf"
    make_tiny(dst)
    return dst


@pytest.fixture(scope="session")
def tiny_hybrid(tiny_hf, tmp_path_factory) -> Path:
    from gptoss_cli.checkpoint.convert import convert

    dst = tmp_path_factory.mktemp("tinyhyb") / "hybrid"
    convert(str(tiny_hf), dst)
    return dst


def signal_name(code: int) -> str:
    return signal.Signals(-code).name if code < 0 else str(code)


def stop_mid_write(args: list, dst: Path, reset, shard: str = "*.safetensors", attempts: int = 5) -> subprocess.Popen:
    """Start `gptoss ARGS` writing DST and SIGSTOP it while its temporary folder (.DST.partial-PID) holds a file
    matching `shard`; the stopped process is returned (the caller sends the kill).

    The write window of a tiny model is short, so a run that finishes before it is seen is retried;
    `reset()` puts DST back as the test set it up before each attempt (the finished run replaced or
    created it).
    """
    for _ in range(attempts):
        reset()
        proc = start(*args)

        def mid_write():
            for tmp in dst.parent.glob(f".{dst.name}.partial-{proc.pid}"):
                if any(tmp.glob(shard)):
                    return tmp
            return "exited" if proc.poll() is not None else None

        seen = wait_for(mid_write, 120, f"{dst}'s temporary folder", interval=0.0002)
        if seen != "exited":
            os.kill(proc.pid, signal.SIGSTOP)
            if seen.exists():
                return proc
            os.kill(proc.pid, signal.SIGCONT)
        proc.communicate(timeout=60)
        assert proc.returncode == 0, proc.stderr
    pytest.fail(f"never caught `gptoss {args[0]}` mid-write in {attempts} attempts")
