"""llama.cpp through llama-cpp-python, in a separate interpreter (its own venv, as vLLM runs in its own).

`LlamaCppEngine(python)` runs llamacpp_worker.py under that interpreter (the `python` argument, else
$GPTOSS_LLAMACPP_PYTHON, else this interpreter when it can import llama_cpp), `load_model` gives it a GGUF file,
and it answers the Engine interface of base.py for what serve-check needs: `score` (prompt log-probabilities,
the whole vocabulary or the top-k and the actual next token) and greedy `generate`. llama.cpp's own output goes
to a log file; a failure is one line with llama.cpp's message (EngineError, exit 2), a worker that dies or
answers something that is not the protocol's JSON too (worker_process.py).

Settings that make the served model the one gptoss computes: the KV cache in float32 (`kv_cache="f32"`; llama.cpp's
default, f16, rounds every key and value: docs/serve-check.md says what that adds), flash attention off, one
ubatch per prompt, logits for every position.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

from gptoss_cli.generate.engines.base import Completion, EngineError, EngineInfo, PromptScores, SamplingParams, one_line
from gptoss_cli.generate.engines.worker_process import WorkerProcess

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
        self._worker = WorkerProcess("llama.cpp", self.python, WORKER, prefix="gptoss-llamacpp-", log_dir=log_dir)
        self._tmp, self.log_path = self._worker.folder, self._worker.log_path
        try:
            hello = self._worker.call({"op": "hello"}, what=f"importing llama_cpp in {self.python}")
        except BaseException:
            self.close()
            raise
        self.info = EngineInfo("llama.cpp", str(hello.get("version", "unknown")), device="cpu", python=self.python)
        self.info.notes.append(f"llama.cpp system info: {one_line(hello.get('system', ''), 300)}")
        self.model: str | None = None
        self.last_seconds: float | None = None

    # --- the Engine interface -------------------------------------------------------------
    def load_model(self, gguf_file: str | Path, *, n_ctx: int, kv_cache: str = "f32", seed: int = 0) -> float:
        """Load a GGUF file (absolute path: the worker runs in a folder of its own); its seconds."""
        if kv_cache not in KV_CACHE_TYPES:
            raise EngineError(f"--kv-cache {kv_cache!r} is not one of {', '.join(KV_CACHE_TYPES)}")
        path = str(Path(gguf_file).expanduser().resolve())
        answer = self._worker.call({"op": "load", "model": path, "n_ctx": int(n_ctx), "kv_cache": kv_cache, "seed": seed,
                             "threads": self.threads}, what=f"loading {gguf_file}")
        self.info.kernels = {"kv_cache": kv_cache, "flash_attention": "off"}
        self.model, self.vocab_size = path, int(answer["n_vocab"])
        return float(answer["seconds"])

    def score(self, prompts: Sequence[Sequence[int]], top_k: int | None = None) -> list[PromptScores]:
        import numpy as np

        out = self._tmp / "scores.npz"
        answer = self._worker.call({"op": "score", "prompts": [list(map(int, p)) for p in prompts], "top_k": top_k,
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
        answer = self._worker.call({"op": "generate", "prompts": [list(map(int, p)) for p in prompts],
                             "max_tokens": sampling.max_tokens}, what="generating")
        return [Completion(c["ids"], c["logprobs"], c.get("finish_reason")) for c in answer["completions"]]

    def load_weights(self, folder: str) -> None:
        raise EngineError("the llama.cpp engine serves a GGUF file; it takes no weight pushes")

    def keep_log(self) -> None:
        self._worker.keep_log()

    def close(self) -> None:
        self._worker.close()

    def __enter__(self) -> "LlamaCppEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["LlamaCppEngine", "engine_python", "LLAMACPP_PYTHON_ENV", "KV_CACHE_TYPES", "WORKER"]
