"""`serve-check --engine llamacpp`: prove that llama.cpp computes, from a GGUF, what gptoss computes for a checkpoint.

Steps: open the checkpoint and choose the prompts (as for vLLM), export the GGUF with gptoss's own convert (or
take `--export FILE.gguf`, checked to hold this checkpoint's model), read from its header the types llama.cpp
will compute with, build gptoss's model with the weights rounded as the GGUF rounds them
(engine_rounding.py) and with llama.cpp's known departures applied (below), run its forward and greedy
continuation (reference.py), add to the float32 budget the spread of llama.cpp's activation and KV-cache
roundings, start llama.cpp (generate/engines/llamacpp.py) on the file, score the same ids and greedy-continue,
and compare position by position (report.py).

Known departures, named as findings before any number is looked at:
- yarn_truncate: llama.cpp rounds YaRN's correction dimensions (ggml_rope_yarn_corr_dims: floor and ceil) and its
  gpt-oss graph passes no per-dimension frequency factors to its RoPE (src/models/openai-moe.cpp hands
  ggml_rope_ext none), so no GGUF key or tensor makes it compute GPT-OSS's `truncate: false` frequencies.
  gptoss's reference then computes with the rounded ones, and the finding says how far that moves gptoss's
  own log-probabilities on these prompts: what llama.cpp's serving of this model cannot match.
- swiglu: llama.cpp's gpt-oss expert activation has alpha 1.702 and limit 7 built in; another checkpoint fails.
What llama.cpp computes as GPT-OSS does: the window (a key is visible from q - W + 1 on, as gptoss), the sinks,
top-k routing with the softmax over the chosen logits, non-alternating layer_types (the export writes
attention.sliding_window_pattern), the YaRN attention factor.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from gptoss_cli.errors import UsageError
from gptoss_cli.parity.serve.report import ServeFinding, ServeReport, compare_prompt

GGUF_DTYPES = ("f32", "bf16", "f16", "q8_0")
KV_CACHES = ("f32", "f16")


def _gguf_types(path: Path, kv_cache: str):
    from gptoss_cli.checkpoint.formats.gguf.reader import read_header
    from gptoss_cli.parity.serve.engine_rounding import GgufTypes

    tensors = read_header(path).tensors
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_gate_exps.weight"):
        if name not in tensors:
            raise UsageError(f"--export {path}: has no tensor {name!r}; not a gpt-oss GGUF")
    return GgufTypes(tensors["blk.0.attn_q.weight"].type_name, tensors["blk.0.ffn_gate_exps.weight"].type_name,
                     kv_cache.upper())


def check_same_model(path: Path, arch, checkpoint: str) -> None:
    """A GGUF given with --export must hold this checkpoint's architecture (one line naming a difference)."""
    from gptoss_cli.checkpoint.formats import GGUF

    if not GGUF.detect(path):
        raise UsageError(f"--export {path}: not a GGUF file")
    theirs, _ = GGUF.architecture(path)
    diffs = [d for d in theirs.differences(arch) if not d.startswith("rope_truncate")]
    if diffs:
        raise UsageError(f"--export {path}: holds another model than {checkpoint} ({diffs[0]})",
                         hint="export it again from this checkpoint, or check the checkpoint it was made from")


def _export(checkpoint: str, options, work: Path, say) -> tuple[Path, list[str]]:
    if options.export is not None:
        return Path(options.export), []
    from gptoss_cli.checkpoint.convert import convert

    say("exporting the GGUF")
    out = work / "model.gguf"
    result = convert(checkpoint, out, to="gguf", dtype=options.dtype, experts=options.experts or "mxfp4")
    return out, list(result.notes)


def _findings(arch, model_logprobs_moved: float | None) -> list[ServeFinding]:
    out = []
    if model_logprobs_moved is not None:
        out.append(ServeFinding(
            "yarn_truncate", "llama.cpp rounds YaRN's correction dimensions and its gpt-oss graph takes no per-dimension "
            "frequency factors, so it cannot compute this checkpoint's truncate: false frequencies (no GGUF key or "
            "rope_freqs tensor changes that); checked against gptoss computing the rounded ones, which moves gptoss's "
            f"own log-probabilities on these prompts by up to {model_logprobs_moved:.3g}"))
    if arch.swiglu_limit != 7.0 or arch.swiglu_alpha != 1.702:
        out.append(ServeFinding("swiglu", f"llama.cpp's gpt-oss experts have limit 7 and alpha 1.702 built in; this "
                                f"checkpoint's are {arch.swiglu_limit} and {arch.swiglu_alpha}", failing=True))
    return out


def _references(checkpoint: str, prompts, types, arch, greedy_tokens: int, say):
    """gptoss's references with the GGUF's weight rounding and llama.cpp's RoPE; the truncation's own effect."""
    import torch

    from gptoss_cli.checkpoint.load import model_from_checkpoint
    from gptoss_cli.model.rope import yarn_inv_freq
    from gptoss_cli.parity.serve import engine_rounding as er
    from gptoss_cli.parity.serve.reference import reference_for

    model = model_from_checkpoint(checkpoint, dtype=torch.float32).eval()
    er.round_weights(model, types)
    moved = None
    as_trained = model.rotary_pos_emb.inv_freq.clone()
    truncates = not arch.rope_truncate and arch.rope_scaling_factor > 1
    if truncates:
        model.rotary_pos_emb.inv_freq = yarn_inv_freq(arch.replace(rope_truncate=True))[0]
    refs = []
    for name, ids in prompts:
        say(f"gptoss's forward: {name}")
        ref = reference_for(model, name, ids, greedy_tokens=greedy_tokens, dtype=torch.float32)
        spread = er.rounding_spread(model, ref.ids, ref.logprobs, types)
        extra = er.budget_from(spread)
        ties = er.near_ties(model, ref.ids, spread)
        if ties:
            from gptoss_cli.parity.serve.reference import flip_spread

            near = torch.stack(ties).any(dim=0)
            extra = extra + flip_spread(model, ref.ids, ties, near, ref.logprobs)
            ref.near_tie = ref.near_tie | near
        ref.budget = ref.budget + extra
        ref.logit_bound = ref.logit_bound + torch.cat([extra, extra[-1:]])
        refs.append(ref)
    if truncates:
        moved = _truncation_effect(model, refs, as_trained)
    del model
    return refs, moved


def _truncation_effect(model, refs, as_trained) -> float:
    import torch

    rounded = model.rotary_pos_emb.inv_freq
    model.rotary_pos_emb.inv_freq = as_trained
    worst = 0.0
    with torch.no_grad():
        for ref in refs:
            logits = model(torch.tensor([ref.ids])).logits.reshape(len(ref.ids), -1)
            lp = torch.log_softmax(logits.double(), dim=-1)[:-1]
            worst = max(worst, float((lp - ref.logprobs).abs().max()))
    model.rotary_pos_emb.inv_freq = rounded
    return worst


def _open(checkpoint: str):
    from gptoss_cli.checkpoint.sources import open_source

    source = open_source(checkpoint)
    try:
        return source.kind, source.arch, Path(source.extras_folder)
    finally:
        source.close()


def serve_check_llamacpp(checkpoint: str, options, say, *, full_vocab_limit: int, default_top_k: int) -> ServeReport:
    """The whole check with llama.cpp (module docstring); `options` a ServeCheckOptions; the engine's top-k above
    `full_vocab_limit` tokens (as for vLLM)."""
    from gptoss_cli.generate.engines.base import SamplingParams
    from gptoss_cli.generate.engines.llamacpp import LlamaCppEngine, engine_python
    from gptoss_cli.parity.serve.prompts import load_prompts

    t_start, timings = time.perf_counter(), {}
    python = engine_python(options.engine_python)  # fails early when llama.cpp is missing
    kind, arch, extras = _open(checkpoint)
    tokenizer = Path(options.tokenizer) if options.tokenizer else extras / "tokenizer.json"
    prompts = load_prompts(arch, Path(options.prompts) if options.prompts else None, tokenizer)
    top_k = options.top_k if options.top_k is not None else (None if arch.vocab_size <= full_vocab_limit else default_top_k)
    if options.export is not None:
        check_same_model(Path(options.export), arch, checkpoint)
    work = Path(options.work_dir) if options.work_dir else Path(tempfile.mkdtemp(prefix="gptoss-serve-check-"))
    work.mkdir(parents=True, exist_ok=True)
    engine = None
    try:
        t0 = time.perf_counter()
        gguf_file, notes = _export(checkpoint, options, work, say)
        timings["export"] = time.perf_counter() - t0
        types = _gguf_types(gguf_file, options.kv_cache)
        t0 = time.perf_counter()
        refs, moved = _references(checkpoint, prompts, types, arch, options.greedy_tokens, say)
        timings["gptoss_forward"] = time.perf_counter() - t0
        say("starting llama.cpp")
        t0 = time.perf_counter()
        engine = LlamaCppEngine(python)
        timings["engine_load"] = engine.load_model(gguf_file, n_ctx=max(len(r.ids) for r in refs) + 8,
                                                   kv_cache=options.kv_cache)
        timings["engine_start"] = time.perf_counter() - t0
        say("scoring")
        t0 = time.perf_counter()
        scores = engine.score([r.ids for r in refs], top_k=top_k)
        greedy = engine.generate([r.ids[:r.prompt_len] for r in refs],
                                 SamplingParams(max_tokens=max(options.greedy_tokens, 1))) \
            if options.greedy_tokens else [None] * len(refs)
        timings["engine_score"] = time.perf_counter() - t0
        results = [compare_prompt(r, s, list(g.ids[:options.greedy_tokens]) if g else [])
                   for r, s, g in zip(refs, scores, greedy)]
        if any(p.verdict != "pass" for p in results):
            engine.keep_log()
        info = engine.info.to_json()
    finally:
        if engine is not None:
            engine.close()
        if options.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    timings["total"] = time.perf_counter() - t_start
    served = {"model": str(gguf_file) if options.work_dir or options.export else "(temporary GGUF)",
              "form": f"GGUF ({types.main} weights, {types.experts} experts, {types.kv_cache} KV cache)",
              "adapter": None, "artifacts": {}, "top_k": top_k}
    error_model = (f"per position: the float32 budget + 4 x the spread of llama.cpp's roundings ({types.main} weights: "
                   f"activations to {_vec(types.main)}; {types.experts} experts: to {_vec(types.experts)}; "
                   f"{types.kv_cache} KV cache); weights rounded as the GGUF holds them; router near-ties excluded")
    return ServeReport(checkpoint, kind, types.main.lower(), served, info, error_model, results,
                       _findings(arch, moved), {k: round(v, 3) for k, v in timings.items()}, notes=notes)


def _vec(ggml_type: str) -> str:
    from gptoss_cli.parity.serve.engine_rounding import VEC_DOT

    return VEC_DOT[ggml_type]


__all__ = ["serve_check_llamacpp", "check_same_model", "GGUF_DTYPES", "KV_CACHES"]
