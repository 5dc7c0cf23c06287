"""A stand-in for vLLM behind gptoss's own engine seam: transformers' GptOssForCausalLM answering vllm_worker.py's protocol.

`fake_engine_python(folder)` writes an executable that `VllmEngine` runs as if it were the engine's
interpreter ($GPTOSS_ENGINE_PYTHON): it starts this file instead of vllm_worker.py, under this
interpreter, so everything on gptoss's side (the process, its temporary folder, the paths handed over,
the pushes, the fingerprint) runs as with vLLM, without vLLM. The model is transformers' own (eager
attention, fp32), an implementation independent of gptoss's. Every request is appended to the JSONL
file $GPTOSS_FAKE_ENGINE_RECORD names, with the engine's working folder, so tests can see what it was
handed and from where.

Run as a script, this file is that worker: it imports only the standard library, torch, safetensors and
transformers (never gptoss, as the real worker).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

RECORD_ENV = "GPTOSS_FAKE_ENGINE_RECORD"


def fake_engine_python(folder: Path) -> str:
    """An executable in `folder` to pass as the engine's Python: it runs this file with this interpreter."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "fake-engine-python"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def records(path: Path) -> list[dict]:
    """The requests the fake engine was sent, in order."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# --- the worker ---------------------------------------------------------------------------------------------
STATE: dict = {}


def _record(req: dict) -> None:
    path = os.environ.get(RECORD_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({**{k: v for k, v in req.items() if k != "prompts"}, "cwd": os.getcwd()}) + "\n")


def _load(folder: str):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    return model


def _logits(ids: list[list[int]]):
    import torch

    with torch.no_grad():
        return STATE["model"](torch.tensor(ids)).logits.double()


def op_start(req: dict) -> dict:
    STATE["model"] = _load(req["model"])
    return {"seconds": 0.0, "kernels": {"attention": "transformers eager"}}


def op_load_weights(req: dict) -> dict:
    STATE["model"] = _load(req["folder"])
    return {"seconds": 0.0}


def op_score(req: dict) -> dict:
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for i, p in enumerate(req["prompts"]):
        lp = torch.log_softmax(_logits([p])[0, :-1], dim=-1).float()
        if req.get("top_k") is None:
            tensors[f"logprobs.{i}"] = lp.contiguous()
        else:
            k = int(req["top_k"])
            top = lp.topk(k, dim=-1)
            actual = torch.tensor(p[1:])[:, None]
            tensors[f"ids.{i}"] = torch.cat([top.indices, actual], dim=1).contiguous()
            tensors[f"logprobs.{i}"] = torch.cat([top.values, lp.gather(1, actual)], dim=1).contiguous()
    save_file(tensors, req["out"])
    return {"seconds": 0.0}


def op_generate(req: dict) -> dict:
    """Each prompt continued alone: greedy at temperature 0, else sampled from softmax(logits / T) with its seed;
    the log-probability reported is the sampled distribution's (vLLM's processed_logprobs)."""
    import torch

    s = req["sampling"]
    seeds = s.get("seeds") or [s["seed"]] * len(req["prompts"])
    out = []
    for prompt, seed in zip(req["prompts"], seeds):
        gen = torch.Generator().manual_seed(int(seed))
        ids, lps, finish = [], [], "length"
        for _ in range(int(s["max_tokens"])):
            logits = _logits([list(prompt) + ids])[0, -1]
            t = float(s["temperature"])
            lp = torch.log_softmax(logits / t if t > 0 else logits, dim=-1)
            tok = int(lp.argmax()) if t == 0 else int(torch.multinomial(lp.exp(), 1, generator=gen))
            ids.append(tok)
            lps.append(float(lp[tok]))
            if tok in s["stop_token_ids"]:
                finish = "stop"
                break
        out.append({"ids": ids, "logprobs": lps, "finish_reason": finish})
    return {"completions": out, "seconds": 0.0}


OPS = {"hello": lambda req: {"version": "fake", "device": "cpu"}, "start": op_start, "score": op_score,
       "generate": op_generate, "load_weights": op_load_weights}


def main() -> int:
    for line in sys.stdin:
        req = json.loads(line)
        _record(req)
        if req["op"] == "close":
            print(json.dumps({"ok": True}), flush=True)
            return 0
        try:
            answer = {"ok": True, **OPS[req["op"]](req)}
        except Exception as exc:  # noqa: BLE001 - answered, as the real worker does
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
