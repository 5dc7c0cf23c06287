"""The llama.cpp side of gptoss's llama.cpp engine: a script run by the interpreter that has llama-cpp-python.

It never imports gptoss: only the standard library at import, llama_cpp and numpy inside the operations. The
parent (llamacpp.py) starts it as `PYTHON llamacpp_worker.py` and talks JSON, one object per line: requests on
stdin, answers on the protocol stream (the process's original stdout; llama.cpp's own log goes to stderr, which
the parent keeps in a log file). Every answer is {"ok": true, ...} or {"ok": false, "error": "<type: message>"}.
Log-probabilities go to a .npz file the request names.

Operations: hello (versions), load (a GGUF file: context size, KV-cache types, threads), score (per prompt the
log-softmax of every position's logits, in float64 from llama.cpp's float32 logits: the whole vocabulary, or
the top-k and the token that follows), generate (greedy: the argmax of llama.cpp's logits, one token at a
time through its KV cache), close. Flash attention is off (llama-cpp-python's default) and every prompt
starts from an empty cache.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

# This script's folder holds gptoss modules, never what llama_cpp imports.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

STATE: dict = {}
KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:2000]


def op_hello(req: dict) -> dict:
    import platform

    import llama_cpp
    import numpy

    return {"version": getattr(llama_cpp, "__version__", "unknown"), "numpy": numpy.__version__,
            "python": sys.executable, "machine": platform.machine(),
            "system": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


def op_load(req: dict) -> dict:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    STATE.pop("llm", None)
    n_ctx = int(req["n_ctx"])
    llm = Llama(model_path=req["model"], n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                n_threads=int(req.get("threads") or os.cpu_count() or 1), seed=int(req.get("seed", 0)),
                type_k=KV_TYPES[req["kv_cache"]], type_v=KV_TYPES[req["kv_cache"]], flash_attn=False,
                use_mmap=False, verbose=True)
    STATE["llm"] = llm
    return {"seconds": time.perf_counter() - t0, "n_vocab": llm.n_vocab(), "n_ctx": llm.n_ctx()}


ROWS = 32  # positions turned into log-probabilities at a time (a row of the real vocabulary is 1.6 MB in float64)


def _log_softmax(x):
    import numpy as np

    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def _prompt_logprobs(llm, ids: list[int], top_k: int | None):
    """(log-probs [n - 1, V or K + 1], ids [n - 1, K + 1] or None) of one prompt, from an empty cache."""
    import numpy as np

    llm.reset()
    llm.eval(ids)
    n = len(ids) - 1
    width = llm.n_vocab() if top_k is None else top_k + 1
    lp_out = np.empty((n, width), dtype=np.float64)
    ids_out = None if top_k is None else np.empty((n, width), dtype=np.int64)
    for r0 in range(0, n, ROWS):
        r1 = min(n, r0 + ROWS)
        lp = _log_softmax(np.array(llm.scores[r0:r1], dtype=np.float64))
        if top_k is None:
            lp_out[r0:r1] = lp
            continue
        top = np.argsort(-lp, axis=-1, kind="stable")[:, :top_k]
        nxt = np.asarray(ids[r0 + 1:r1 + 1], dtype=np.int64)[:, None]
        keep = np.concatenate([top, np.where((top == nxt).any(axis=-1, keepdims=True), -1, nxt)], axis=-1)
        ids_out[r0:r1] = keep
        lp_out[r0:r1] = np.where(keep >= 0, np.take_along_axis(lp, np.maximum(keep, 0), axis=-1), -np.inf)
    return lp_out, ids_out


def op_score(req: dict) -> dict:
    import numpy as np

    llm, top_k, out = STATE["llm"], req.get("top_k"), {}
    t0 = time.perf_counter()
    for i, ids in enumerate(req["prompts"]):
        lp, kept = _prompt_logprobs(llm, ids, top_k)
        out[f"logprobs.{i}"] = lp
        if kept is not None:
            out[f"ids.{i}"] = kept
    np.savez(req["out"], **out)
    return {"seconds": time.perf_counter() - t0}


def op_generate(req: dict) -> dict:
    import numpy as np

    llm, completions = STATE["llm"], []
    for ids in req["prompts"]:
        llm.reset()
        llm.eval(ids)
        new, logprobs = [], []
        for _ in range(int(req["max_tokens"])):
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            token = int(row.argmax())
            new.append(token)
            logprobs.append(float(_log_softmax(row)[token]))
            llm.eval([token])
        completions.append({"ids": new, "logprobs": logprobs, "finish_reason": "length"})
    return {"completions": completions}


OPS = {"hello": op_hello, "load": op_load, "score": op_score, "generate": op_generate}


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # everything else printed goes to the log
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("op") == "close":
            protocol.write(json.dumps({"ok": True}) + "\n")
            break
        try:
            answer = {"ok": True, **OPS[req["op"]](req)}
        except Exception as exc:  # noqa: BLE001 - every failure is an answer
            traceback.print_exc()
            answer = {"ok": False, "error": _one_line(exc)}
        protocol.write(json.dumps(answer) + "\n")
    STATE.clear()


if __name__ == "__main__":
    main()
