"""llama.cpp through llama-cpp-python, in a separate interpreter (its own venv, as vLLM runs in its own).

`LlamaCppEngine(python)` runs llamacpp_worker.py under that interpreter (the `python` argument, else
$GPTOSS_LLAMACPP_PYTHON, else this interpreter when it can import llama_cpp), `load_model` gives it a GGUF file,
and it answers the Engine interface of base.py for what serve-check needs: `score` (prompt log-probabilities,
the whole vocabulary or the top-k and the actual next token) and greedy `generate`. llama.cpp's own output goes
to a log file; a failure is one line with llama.cpp's message (EngineError, exit 2), a worker that dies or
answers something that is not the protocol's JSON too.

Settings that make the served model the one gptoss computes: the KV cache in float32 (`kv_cache="f32"`; llama.cpp's
default, f16, rounds every key and value: docs/serve-check.md says what that adds), flash attention off, one
ubatch per prompt, logits for every position.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from gptoss_cli.generate.engines.base import Completion, EngineError, EngineInfo, PromptScores, SamplingParams, one_line

WORKER = Path(__file__).with_name("llamacpp_worker.py")
LLAMACPP_PYTHON_ENV = "GPTOSS_LLAMACPP_PYTHON"
KV_CACHE_TYPES = ("f32", "f16")


def engine_python(python: str | None = None) -> str:
    """The interpreter with llama-cpp-python: `python`, else $GPTOSS_LLAMACPP_PYTHON, else this one if it has it."""
    chosen = python or os.environ.get(LLAMACPP_PYTHON_ENV)
    if chosen:
        path = shutil.which(chosen) or chosen
        if not Path(path).is_file() or not os.access(path, os.X_OK):
            where = "--engine-python" if python else f"${LLAMACPP_PYTHON_ENV}"
            raise EngineError(f"{where} {chosen}: not an executable Python interpreter",
                              hint="the python of the venv llama-cpp-python is installed in (docs/serve-check.md)")
        return str(Path(path).absolute())
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    raise EngineError("no Python interpreter with llama-cpp-python: pass --engine-python PATH or set "
                      f"{LLAMACPP_PYTHON_ENV}", hint="install llama-cpp-python in its own venv (docs/serve-check.md)")


class LlamaCppEngine:
    """llama.cpp on one GGUF file, in a worker process (see the module docstring)."""

    def __init__(self, python: str | None = None, *, log_dir: str | Path | None = None, threads: int | None = None):
        self.python = engine_python(python)
        self.threads = threads
        self._tmp = Path(tempfile.mkdtemp(prefix="gptoss-llamacpp-", dir=log_dir))
        self.log_path = self._tmp / "engine.log"
        self._log = open(self.log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONPATH", None)  # the engine's venv, not ours
        self._closed, self._keep_log = True, False
        try:
            self._proc = subprocess.Popen([self.python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=self._log, env=env, cwd=str(self._tmp))
        except OSError as exc:
            self._cleanup()
            raise EngineError(f"--engine-python {self.python}: cannot start ({exc.strerror or exc})") from None
        self._closed = False
        try:
            hello = self._call({"op": "hello"}, what=f"importing llama_cpp in {self.python}")
        except BaseException:
            self.close()
            raise
        self.info = EngineInfo("llama.cpp", str(hello.get("version", "unknown")), device="cpu", python=self.python)
        self.info.notes.append(f"llama.cpp system info: {one_line(hello.get('system', ''), 300)}")
        self.model: str | None = None
        self.last_seconds: float | None = None

    # --- the worker ----------------------------------------------------------------------
    def _call(self, request: dict[str, Any], what: str) -> dict[str, Any]:
        if self._closed:
            raise EngineError(f"llama.cpp {what}: the engine process is not running{self._log_tail()}")
        if self._proc.poll() is not None:  # it ended before this request (a crash at start-up, on a slow host)
            self._keep_log = True
            raise EngineError(f"llama.cpp {what}: the engine process ended (exit {self._proc.returncode})"
                              f"{self._log_tail()}", hint=f"the engine's log: {self.log_path}")
        try:
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = b""
        if not line:
            code = self._proc.wait()
            self._keep_log = True
            raise EngineError(f"llama.cpp {what}: the engine process ended (exit {code}){self._log_tail()}",
                              hint=f"the engine's log: {self.log_path}")
        try:
            answer = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            answer = None
        if not isinstance(answer, dict):
            self._keep_log = True
            raise EngineError(f"llama.cpp {what}: the engine answered {one_line(line.decode(errors='replace'), 200)!r}, "
                              "not the worker's JSON", hint=f"the engine's log: {self.log_path}")
        if not answer.get("ok"):
            self._keep_log = True
            raise EngineError(f"llama.cpp {what}: {one_line(answer.get('error', 'failed'))}",
                              hint=f"the engine's log: {self.log_path}")
        return answer

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            if "error" in line.lower() or "failed" in line.lower():
                return f": {one_line(line, 400)}"
        return ""

    # --- the Engine interface -------------------------------------------------------------
    def load_model(self, gguf_file: str | Path, *, n_ctx: int, kv_cache: str = "f32", seed: int = 0) -> float:
        """Load a GGUF file (absolute path: the worker runs in a folder of its own); its seconds."""
        if kv_cache not in KV_CACHE_TYPES:
            raise EngineError(f"--kv-cache {kv_cache!r} is not one of {', '.join(KV_CACHE_TYPES)}")
        path = str(Path(gguf_file).expanduser().resolve())
        answer = self._call({"op": "load", "model": path, "n_ctx": int(n_ctx), "kv_cache": kv_cache, "seed": seed,
                             "threads": self.threads}, what=f"loading {gguf_file}")
        self.info.kernels = {"kv_cache": kv_cache, "flash_attention": "off"}
        self.model, self.vocab_size = path, int(answer["n_vocab"])
        return float(answer["seconds"])

    def score(self, prompts: Sequence[Sequence[int]], top_k: int | None = None) -> list[PromptScores]:
        import numpy as np

        out = self._tmp / "scores.npz"
        answer = self._call({"op": "score", "prompts": [list(map(int, p)) for p in prompts], "top_k": top_k,
                             "out": str(out)}, what="scoring the prompts")
        self.last_seconds = float(answer["seconds"])
        with np.load(out) as data:
            tensors = {k: data[k] for k in data.files}
        out.unlink()
        results = []
        for i, p in enumerate(prompts):
            lp = tensors.get(f"logprobs.{i}")
            if lp is None or lp.ndim != 2 or lp.shape[0] != len(p) - 1:
                raise EngineError(f"llama.cpp scoring the prompts: prompt {i}'s log-probabilities have shape "
                                  f"{None if lp is None else list(lp.shape)}, not {len(p) - 1} rows")
            results.append(PromptScores(list(map(int, p)), lp, None if top_k is None else tensors[f"ids.{i}"]))
        return results

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Completion]:
        if sampling.temperature != 0:
            raise EngineError("the llama.cpp engine generates greedily only (temperature 0)")
        answer = self._call({"op": "generate", "prompts": [list(map(int, p)) for p in prompts],
                             "max_tokens": sampling.max_tokens}, what="generating")
        return [Completion(c["ids"], c["logprobs"], c.get("finish_reason")) for c in answer["completions"]]

    def load_weights(self, folder: str) -> None:
        raise EngineError("the llama.cpp engine serves a GGUF file; it takes no weight pushes")

    def keep_log(self) -> None:
        self._keep_log = True

    def close(self) -> None:
        if getattr(self, "_closed", True):
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
        if not self._keep_log:  # a failure's log stays for the user to read
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "LlamaCppEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["LlamaCppEngine", "engine_python", "LLAMACPP_PYTHON_ENV", "KV_CACHE_TYPES", "WORKER"]
