"""The vLLM side of gptoss's offline engine: a script run by the interpreter that has vLLM installed.

It never imports gptoss (that interpreter pins its own torch and transformers): only the standard
library at import, vLLM and torch inside the operations. The parent (vllm_offline.py) starts it as
`PYTHON vllm_worker.py` and talks JSON, one object per line: requests on stdin, answers on the
protocol stream (the process's original stdout; everything else vLLM and its libraries print goes to
stderr, which the parent keeps in a log file). Every answer is {"ok": true, ...} or {"ok": false,
"error": "<the exception's type and message on one line>"}. Large results (prompt logprobs) go to
a safetensors file the request names.

Operations: hello (versions), start (build an LLM on an HF folder; one at a time), score (prompt
logprobs), generate (ids and sampled-token logprobs; one seed per prompt when `seeds` is given; with
`routed_experts` at start, each completion's routed experts, vLLM's [tokens, layers, k] array as base64
bytes, shape and dtype),
load_weights (the served weights replaced by a folder's, `_reload_from_fresh_model`; method
"vllm_inplace" is vLLM's own in-place reload, which misses tensors on GPT-OSS; then the prefix cache
reset), close.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

# The engine core runs in this process, so the model is reachable (kernels, reload) and vLLM is
# imported once; set before vLLM is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# This script's folder holds gptoss modules, never what vLLM imports.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

STATE: dict = {}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:2000]


def op_hello(req: dict) -> dict:
    import platform

    import torch
    import vllm

    return {"version": getattr(vllm, "__version__", "unknown"), "torch": torch.__version__,
            "python": sys.executable, "machine": platform.machine(), "device": _device()}


def _device() -> str:
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type or "unknown")
    except Exception:  # noqa: BLE001 - only a label
        return "unknown"


def _model():
    llm = STATE["llm"]
    try:
        return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    except AttributeError:
        return None


def _kernels() -> dict:
    """Class names of the attention and MoE kernels vLLM chose for the model (best effort)."""
    model = _model()
    out: dict = {}
    if model is None:
        return out
    for name, module in model.named_modules():
        impl = getattr(module, "impl", None)
        if "attention" not in out and impl is not None and "Attention" in type(module).__name__:
            out["attention"] = type(impl).__name__
        quant = getattr(module, "quant_method", None)
        if "moe" not in out and quant is not None and "experts" in name:
            kernel = getattr(quant, "moe_kernel", None)
            inner = getattr(getattr(kernel, "impl", None), "fused_experts", None) if kernel is not None else None
            out["moe"] = type(inner if inner is not None else quant).__name__
    return out


def op_start(req: dict) -> dict:
    from vllm import LLM

    if STATE.get("llm") is not None:
        _shutdown()
    t0 = time.perf_counter()
    kwargs = dict(model=req["model"], dtype=req["dtype"], max_model_len=int(req["max_model_len"]),
                  max_num_batched_tokens=int(req["max_model_len"]), enforce_eager=True, skip_tokenizer_init=True,
                  max_logprobs=-1, seed=int(req.get("seed", 0)), enable_prefix_caching=False,
                  logprobs_mode=req.get("logprobs_mode", "raw_logprobs"))
    if req.get("kv_cache_bytes"):
        kwargs["kv_cache_memory_bytes"] = int(req["kv_cache_bytes"])
    if req.get("enable_lora"):
        kwargs.update(enable_lora=True, max_lora_rank=int(req["max_lora_rank"]), max_loras=1)
    if req.get("routed_experts"):
        # vLLM returns routed experts through its auxiliary outputs: model runner V2 (read from the
        # environment when the engine is built) and prefix caching (reset after every weight reload)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        kwargs.update(enable_return_routed_experts=True, enable_prefix_caching=True)
    kwargs.update(req.get("engine_args") or {})
    STATE["llm"] = LLM(**kwargs)
    STATE["lora_ids"] = {}
    return {"seconds": time.perf_counter() - t0, "kernels": _kernels()}


def _lora(path):
    if not path:
        return None
    from vllm.lora.request import LoRARequest

    ids = STATE["lora_ids"]
    ids.setdefault(path, len(ids) + 1)
    return LoRARequest(f"adapter{ids[path]}", ids[path], path)


def op_score(req: dict) -> dict:
    import torch
    from safetensors.torch import save_file
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    top_k = req.get("top_k")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1 if top_k is None else int(top_k),
                            detokenize=False)
    t0 = time.perf_counter()
    outs = STATE["llm"].generate([TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]], params,
                                 use_tqdm=False, lora_request=_lora(req.get("lora")))
    seconds = time.perf_counter() - t0
    tensors = {}
    for i, out in enumerate(outs):
        rows = out.prompt_logprobs[1:]  # position 0 has no prefix
        if top_k is None:
            vocab = int(req["vocab_size"])
            lp = torch.full((len(rows), vocab), float("-inf"), dtype=torch.float32)
            for p, row in enumerate(rows):
                keys = list(row)
                lp[p, keys] = torch.tensor([row[k].logprob for k in keys], dtype=torch.float32)
            tensors[f"logprobs.{i}"] = lp
        else:
            width = int(top_k) + 1
            ids = torch.full((len(rows), width), -1, dtype=torch.int64)
            lp = torch.full((len(rows), width), float("-inf"), dtype=torch.float32)
            for p, row in enumerate(rows):
                keys = list(row)[:width]
                ids[p, :len(keys)] = torch.tensor(keys, dtype=torch.int64)
                lp[p, :len(keys)] = torch.tensor([row[k].logprob for k in keys], dtype=torch.float32)
            tensors[f"logprobs.{i}"], tensors[f"ids.{i}"] = lp, ids
    save_file(tensors, req["out"])
    return {"seconds": seconds}


def op_generate(req: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    s = req["sampling"]

    def params_with(seed):
        return SamplingParams(max_tokens=int(s["max_tokens"]), temperature=float(s["temperature"]),
                              top_p=float(s["top_p"]), seed=int(seed), stop_token_ids=list(s["stop_token_ids"]),
                              logprobs=int(s.get("logprobs", 0)), detokenize=False)

    # one seed per prompt when given (RL: the completions of one prompt must differ), else one for all
    params = [params_with(x) for x in s["seeds"]] if s.get("seeds") else params_with(s["seed"])
    t0 = time.perf_counter()
    outs = STATE["llm"].generate([TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]], params,
                                 use_tqdm=False, lora_request=_lora(req.get("lora")))
    completions = []
    for out in outs:
        c = out.outputs[0]
        lps = [float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs or [])]
        completions.append({"ids": list(c.token_ids), "logprobs": lps, "finish_reason": c.finish_reason,
                            "routed_experts": _array(getattr(c, "routed_experts", None))})
    return {"completions": completions, "seconds": time.perf_counter() - t0}


def _array(a) -> dict | None:
    """A numpy array as JSON: base64 of its bytes, its shape and dtype (None stays None)."""
    if a is None:
        return None
    import base64

    import numpy as np

    a = np.ascontiguousarray(a)
    return {"b64": base64.b64encode(a.tobytes()).decode(), "shape": list(a.shape), "dtype": str(a.dtype)}


def op_load_weights(req: dict) -> dict:
    t0 = time.perf_counter()
    llm = STATE["llm"]
    if req.get("method") == "vllm_inplace":
        llm.collective_rpc("reload_weights", kwargs={"weights_path": req["folder"]})
    else:
        _reload_from_fresh_model(req["folder"])
    llm.reset_prefix_cache()
    return {"seconds": time.perf_counter() - t0}


def _reload_from_fresh_model(folder: str) -> None:
    """The served model's weights replaced by those of `folder`, as vLLM would have them after loading it.

    vLLM's in-place `reload_weights` misses tensors on GPT-OSS: its loader copies the experts and the
    sinks straight into their parameters, past the per-layer loaders the reload counts on, and on CPUs
    the linear layers' weights were packed for oneDNN at load time (max |dlogprob| 2.2 on the tiny
    test model after reloading other weights). Here vLLM's own loader builds a second model from
    `folder` (loading and processing: the experts' CPU packing, the linear layers' packed GEMMs) with the
    attention layers' registry set aside, and its parameters, buffers and GEMM handles replace the served
    model's in place (the KV cache stays bound to the served model's attention layers). The second model
    is kept until the next reload (the packed GEMM handles may refer to it)."""
    import copy

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    runner = STATE["llm"].llm_engine.model_executor.driver_worker.worker.model_runner
    live, config = runner.model, runner.vllm_config
    model_config = copy.copy(config.model_config)
    model_config.model, model_config.model_weights = folder, ""
    registry = config.compilation_config.static_forward_context
    kept = dict(registry)
    registry.clear()
    try:
        with set_current_vllm_config(config):
            fresh = get_model_loader(config.load_config).load_model(vllm_config=config, model_config=model_config)
    finally:
        registry.clear()
        registry.update(kept)
    modules = dict(fresh.named_modules())
    with torch.no_grad():
        for name, module in live.named_modules():
            new = modules[name]
            for pname, p in list(module.named_parameters(recurse=False)):
                q = getattr(new, pname)
                if p.shape == q.shape and p.dtype == q.dtype:
                    p.data.copy_(q.data)
                else:
                    setattr(module, pname, q)
            for bname, b in list(module.named_buffers(recurse=False)):
                q = getattr(new, bname)
                if b.shape == q.shape and b.dtype == q.dtype:
                    b.copy_(q)
            if hasattr(new, "cpu_linear"):
                module.cpu_linear = new.cpu_linear
    STATE["reloaded"] = fresh


def _shutdown() -> None:
    import gc

    llm = STATE.pop("llm", None)
    if llm is not None:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort before the next model
            pass
        del llm
        gc.collect()


OPS = {"hello": op_hello, "start": op_start, "score": op_score, "generate": op_generate,
       "load_weights": op_load_weights}


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes or ends this process
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever vLLM prints goes to stderr, never into the protocol stream
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
        except ValueError as exc:
            protocol.write(json.dumps({"ok": False, "error": f"bad request: {exc}"}) + "\n")
            continue
        op = req.get("op")
        if op == "close":
            _shutdown()
            protocol.write(json.dumps({"ok": True}) + "\n")
            return 0
        try:
            answer = {"ok": True, **OPS[op](req)}
        except BaseException as exc:  # noqa: BLE001 - every failure is answered, the parent decides
            traceback.print_exc(file=sys.stderr)
            answer = {"ok": False, "error": _one_line(exc) if op in OPS else f"unknown op {op!r}"}
        protocol.write(json.dumps(answer) + "\n")
    _shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
