"""An engine's worker script under the engine's own interpreter, one JSON line each way.

vLLM and llama.cpp run in venvs of their own (they pin their own torch, or build native code), so each
engine class starts its worker (vllm_worker.py, llamacpp_worker.py) under that interpreter through
`WorkerProcess`: a scratch folder that goes with this process however it ends (outputs.ScratchFolder),
the engine's output in a log file there (or in a file the caller names), and `call`, which sends one
request and returns the answer. Every way a call can fail (the process ended before or during it, it
answered something that is not the protocol's JSON, or it answered an error) is one EngineError line
naming the engine and what it was doing, with the log's last error line; the log is then kept.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from gptoss_cli.generate.engines.base import EngineError, one_line
from gptoss_cli.outputs import ScratchFolder

ERROR_WORDS = ("error", "failed")  # a log line with one of these (any case) is what a failure message quotes


class WorkerProcess:
    """`engine` (its name in messages) running `worker` under `python`, in a scratch folder of its own."""

    def __init__(self, engine: str, python: str, worker: Path, *, prefix: str, log_dir: str | Path | None = None,
                 log_file: str | Path | None = None):
        """`log_dir`: where the scratch folder goes (default $TMPDIR); `log_file`: the engine's log there instead
        of in the scratch folder (appended to, never removed)."""
        self.engine = engine
        self._closed, self._keep_log = True, False
        self._scratch = ScratchFolder(prefix, log_dir)
        self.folder = self._scratch.path
        self.log_path = Path(log_file).expanduser().resolve() if log_file else self.folder / "engine.log"
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab" if log_file else "wb")
        except OSError as exc:
            self._cleanup()
            raise EngineError(f"{engine}'s log {self.log_path}: cannot be written ({exc.strerror or exc})") from None
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONPATH", None)  # the engine's venv, not ours
        try:
            self._proc = subprocess.Popen([python, str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=self._log, env=env, cwd=str(self.folder))
        except OSError as exc:
            self._cleanup()
            raise EngineError(f"--engine-python {python}: cannot start ({exc.strerror or exc})") from None
        self._closed = False

    def call(self, request: dict[str, Any], what: str) -> dict[str, Any]:
        """Send `request`, return the worker's answer (a dict with "ok" true); anything else is an EngineError."""
        if self._closed:
            raise EngineError(f"{self.engine} {what}: the engine process is not running{self.log_tail()}")
        if self._proc.poll() is not None:  # it ended before this request (a crash at start-up, on a slow host)
            self._fail(f"{what}: the engine process ended (exit {self._proc.returncode}){self.log_tail()}")
        try:
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except OSError:  # BrokenPipeError among them: it ended while reading the request
            line = b""
        if not line:
            code = self._proc.wait()
            self._fail(f"{what}: the engine process ended (exit {code}){self.log_tail()}")
        try:
            answer = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            answer = None
        if not isinstance(answer, dict):
            self._fail(f"{what}: the engine answered {one_line(line.decode(errors='replace'), 200)!r}, "
                       "not the worker's JSON")
        if not answer.get("ok"):
            self._fail(f"{what}: {one_line(answer.get('error', 'failed'))}")
        return answer

    def _fail(self, message: str) -> None:
        self._keep_log = True
        raise EngineError(f"{self.engine} {message}", hint=f"the engine's log: {self.log_path}")

    def log_tail(self) -> str:
        """The last line of the engine's log that reads like an error, for the one-line message."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            if any(word in line.lower() for word in ERROR_WORDS):
                return f": {one_line(line, 400)}"
        return ""

    def keep_log(self) -> None:
        """Keep the engine's log past close (a check failed on what it served)."""
        self._keep_log = True

    def close(self) -> None:
        """Ask the worker to exit (a minute's grace, then kill) and remove the scratch folder unless its log is kept."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._proc.poll() is None:
                self._proc.stdin.write(b'{"op": "close"}\n')
                self._proc.stdin.flush()
                self._proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._cleanup()

    def _cleanup(self) -> None:
        try:
            self._log.close()
        except (AttributeError, OSError):
            pass
        if self._keep_log and self.log_path.parent == self.folder:
            self._scratch.keep()  # a failure's log stays for the user to read
        else:
            self._scratch.remove()


__all__ = ["WorkerProcess", "ERROR_WORDS"]
