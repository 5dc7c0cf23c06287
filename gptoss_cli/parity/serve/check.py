"""`gptoss serve-check`: prove that a serving engine computes what gptoss computes for a checkpoint.

Steps: open the checkpoint (any kind gptoss reads), choose the prompts (prompts.py), run
gptoss's own forward on them (reference.py), write what the engine loads (export.py),
start the engine (gptoss_cli/generate/engines/) on it, score the same ids and greedy-continue them,
then compare position by position against the error budget (budget.py, report.py).
Known ways an engine parts from a checkpoint become named findings (below) before any number is
looked at, so a failure says why when the reason is known.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gptoss_cli.errors import UsageError
from gptoss_cli.model.config import FULL, SLIDING, GptOssArch
from gptoss_cli.parity.serve.report import ServeFinding, ServeReport, compare_prompt

ENGINES = ("vllm", "llamacpp")  # llamacpp: parity/serve/llamacpp.py
LORA_MODES = ("auto", "adapter", "merged")
SERVE_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
DEFAULT_GREEDY_TOKENS = 8
FULL_VOCAB_LIMIT = 8192  # above this the engine returns its top-k (vLLM builds a Python dict per candidate)
DEFAULT_TOP_K = 20

Progress = Callable[[str], None]


@dataclass
class ServeCheckOptions:
    engine: str = "vllm"
    engine_python: str | None = None
    endpoint: str | None = None
    served_model: str | None = None
    dtype: str = "float32"
    experts: str | None = None  # None: as the checkpoint has them; "mxfp4" or "bf16" for the export
    lora: str = "auto"
    export: str | None = None  # check this existing export (HF folder or PEFT adapter) instead of writing one
    prompts: str | None = None
    tokenizer: str | None = None
    top_k: int | None = None  # None: the full vocabulary when it is at most FULL_VOCAB_LIMIT
    greedy_tokens: int = DEFAULT_GREEDY_TOKENS
    work_dir: str | None = None  # keep the exports here (default: a temporary folder, removed)
    kv_cache: str = "f32"  # llamacpp: the KV cache's type (f32, or f16 as llama.cpp defaults to)

    def check(self) -> None:
        if self.engine == "llamacpp" and self.endpoint is None:
            return self._check_llamacpp()
        if self.endpoint is None and self.engine not in ENGINES:
            raise UsageError(f"--engine {self.engine!r} is not one of {', '.join(ENGINES)}",
                             hint="or --endpoint URL for a running OpenAI-compatible server")
        if self.dtype not in SERVE_DTYPES:
            raise UsageError(f"--dtype {self.dtype!r} is not one of float32, bfloat16")
        if self.experts not in (None, "bf16", "mxfp4"):
            raise UsageError(f"--experts {self.experts!r} is not one of bf16, mxfp4")
        if self.lora not in LORA_MODES:
            raise UsageError(f"--lora {self.lora!r} is not one of {', '.join(LORA_MODES)}")
        if self.top_k is not None and not 1 <= self.top_k <= 1 << 20:
            raise UsageError(f"--top-k {self.top_k} must be at least 1")
        if not 0 <= self.greedy_tokens <= 4096:
            raise UsageError(f"--greedy-tokens {self.greedy_tokens} must be in [0, 4096]")
        if self.export is not None and not Path(self.export).is_dir():
            raise UsageError(f"--export {self.export}: no such folder")


    def _check_llamacpp(self) -> None:
        from gptoss_cli.parity.serve.llamacpp import GGUF_DTYPES, KV_CACHES

        if self.dtype not in GGUF_DTYPES + ("float32", "bfloat16"):
            raise UsageError(f"--dtype {self.dtype!r} is not one of {', '.join(GGUF_DTYPES)} (the GGUF's tensors)")
        self.dtype = {"float32": "f32", "bfloat16": "bf16"}.get(self.dtype, self.dtype)
        if self.experts not in (None, "mxfp4", "same"):
            raise UsageError(f"--experts {self.experts!r} is not one of mxfp4, same (the GGUF's experts)")
        if self.kv_cache not in KV_CACHES:
            raise UsageError(f"--kv-cache {self.kv_cache!r} is not one of {', '.join(KV_CACHES)}")
        if self.top_k is not None and not 1 <= self.top_k <= 1 << 20:
            raise UsageError(f"--top-k {self.top_k} must be at least 1")
        if not 0 <= self.greedy_tokens <= 4096:
            raise UsageError(f"--greedy-tokens {self.greedy_tokens} must be in [0, 4096]")
        if self.export is not None and (not Path(self.export).is_file() or not self.export.endswith(".gguf")):
            raise UsageError(f"--export {self.export}: no such GGUF file (llamacpp checks a FILE.gguf)")


# --- known divergences ------------------------------------------------------------------------
def alternating(arch: GptOssArch) -> bool:
    """Whether layer_types is GPT-OSS's default: sliding on even blocks, full on odd ones."""
    return tuple(arch.layer_types) == tuple(SLIDING if i % 2 == 0 else FULL for i in range(arch.num_hidden_layers))


def known_findings(arch: GptOssArch, served_config: dict, engine_name: str, device: str) -> list[ServeFinding]:
    """What is known to part this checkpoint and this engine, before any number is compared."""
    out = []
    if engine_name == "vllm" and not alternating(arch):
        out.append(ServeFinding("layer_types", "vLLM's GPT-OSS gives even blocks the sliding window and odd ones full "
                           "attention whatever config.json's layer_types says; this checkpoint's are "
                           f"{list(arch.layer_types)}, so the engine computes another model"))
    rope = served_config.get("rope_scaling") or served_config.get("rope_parameters") or {}
    if rope.get("rope_type") == "yarn" and "truncate" not in rope and not arch.rope_truncate:
        out.append(ServeFinding("yarn_truncate", "the served config.json has no rope_scaling.truncate, which engines "
                           "read as true (rounded correction dimensions); the checkpoint computes with false"))
    return out


def _served_config(folder: str) -> dict:
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


# --- the check ----------------------------------------------------------------------------------
def _open(checkpoint: str):
    from gptoss_cli.checkpoint.sources import open_source

    source = open_source(checkpoint)
    try:
        return source.kind, source.arch, Path(source.extras_folder)
    finally:
        source.close()


def _engine(options: ServeCheckOptions, arch: GptOssArch, max_len: int, served, dtype: str, timings: dict,
            running=None):
    t0 = time.perf_counter()
    if running is not None:  # an engine process already started (tests, train's hook): load this model into it
        timings["engine_load"] = running.load_model(
            served.model, dtype=dtype, max_model_len=max_len, vocab_size=arch.vocab_size,
            enable_lora=served.adapter is not None, max_lora_rank=_adapter_rank(served.adapter))
        timings["engine_start"] = time.perf_counter() - t0
        return running
    if options.endpoint is not None:
        from gptoss_cli.generate.engines.endpoint import EndpointEngine

        engine = EndpointEngine(options.endpoint, model=options.served_model, vocab_size=arch.vocab_size)
    else:
        from gptoss_cli.generate.engines.vllm_offline import VllmEngine

        engine = VllmEngine(options.engine_python)
        try:
            timings["engine_load"] = engine.load_model(
                served.model, dtype=dtype, max_model_len=max_len, vocab_size=arch.vocab_size,
                enable_lora=served.adapter is not None, max_lora_rank=_adapter_rank(served.adapter))
        except BaseException:
            engine.close()
            raise
    timings["engine_start"] = time.perf_counter() - t0
    return engine


def _engine_device() -> str:
    """Where an offline vLLM started here will run: its CPU build unless this machine has a CUDA GPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_shapes(arch: GptOssArch, checkpoint: str, device: str) -> None:
    """Refuse, before the engine starts (half a minute on a CPU), a model it is known to refuse."""
    from gptoss_cli.generate.engines.vllm_offline import shape_problem

    problem = shape_problem(arch.head_dim, device)
    if problem is not None:
        raise UsageError(f"{checkpoint}: {problem}", hint="a model with head_dim 64, as GPT-OSS has (`gptoss make-tiny "
                         "DST --head-dim 64` for a tiny one), or --endpoint URL of a server that takes it")


def _resolved(checkpoint: str, options: ServeCheckOptions) -> tuple[str, ServeCheckOptions]:
    """Every local path absolute before anything is handed to an engine, which starts in a folder of its own (and
    vLLM reads a relative path that is not a folder there as a Hub repo id); a Hub id stays as it is."""
    import dataclasses

    def absolute(path: str | None) -> str | None:
        if path is None or not Path(path).expanduser().exists():
            return path
        return str(Path(path).expanduser().resolve())

    work = str(Path(options.work_dir).expanduser().resolve()) if options.work_dir else None
    return absolute(checkpoint), dataclasses.replace(options, export=absolute(options.export), work_dir=work,
                                                     prompts=absolute(options.prompts),
                                                     tokenizer=absolute(options.tokenizer))


def _adapter_rank(adapter: str | None) -> int:
    if adapter is None:
        return 16
    rank = int(json.loads((Path(adapter) / "adapter_config.json").read_text()).get("r", 16))
    return max(8, 1 << (rank - 1).bit_length())  # vLLM takes powers of two


def _engine_probe(options: ServeCheckOptions) -> tuple[bool, bool]:
    """(serves PEFT expert adapters, runs MXFP4 experts) for the engine about to be used, from what is
    known of it: vLLM's expert LoRA and MXFP4 MoE kernels are GPU kernels."""
    if options.endpoint is not None:
        return options.lora == "adapter", True
    from gptoss_cli.generate.engines.vllm_offline import engine_python  # noqa: F401  (fails early when missing)

    engine_python(options.engine_python)
    return False, False


def serve_check(checkpoint: str, options: ServeCheckOptions | None = None, progress: Progress | None = None,
                engine=None) -> ServeReport:
    """Run the whole check (module docstring); raises UsageError/EngineError for bad input or a missing engine.

    `engine`: a VllmEngine already started (its interpreter imported vLLM once), into which this
    checkpoint's export is loaded; it is left running. Otherwise one is started and closed here."""
    import torch

    from gptoss_cli.parity.serve.export import prepare_served
    from gptoss_cli.parity.serve.prompts import load_prompts
    from gptoss_cli.parity.serve.reference import references

    options = options or ServeCheckOptions()
    options.check()
    named = checkpoint
    checkpoint, options = _resolved(checkpoint, options)
    if options.engine == "llamacpp" and options.endpoint is None:
        from gptoss_cli.parity.serve.llamacpp import serve_check_llamacpp

        return serve_check_llamacpp(checkpoint, options, progress or (lambda text: None),
                                    full_vocab_limit=FULL_VOCAB_LIMIT, default_top_k=DEFAULT_TOP_K)
    running = engine
    say = progress or (lambda text: None)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    kind, arch, extras = _open(checkpoint)
    tokenizer = Path(options.tokenizer) if options.tokenizer else extras / "tokenizer.json"
    prompts = load_prompts(arch, Path(options.prompts) if options.prompts else None, tokenizer)
    dtype = SERVE_DTYPES[options.dtype]
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    top_k = options.top_k if options.top_k is not None else (None if arch.vocab_size <= FULL_VOCAB_LIMIT else DEFAULT_TOP_K)
    serves_lora, runs_mxfp4 = (engine.info.lora_experts, False) if engine is not None else _engine_probe(options)
    if options.endpoint is None:
        _check_shapes(arch, named, engine.info.device if engine is not None else _engine_device())

    work = Path(options.work_dir) if options.work_dir else Path(tempfile.mkdtemp(prefix="gptoss-serve-check-"))
    work.mkdir(parents=True, exist_ok=True)
    engine = None
    try:
        say("writing what the engine loads")
        t0 = time.perf_counter()
        served = prepare_served(checkpoint, kind, work, dtype=dtype, experts=options.experts, lora_mode=options.lora,
                                engine_serves_expert_lora=serves_lora, engine_runs_mxfp4=runs_mxfp4,
                                export=options.export)
        timings["export"] = time.perf_counter() - t0
        reference_ckpt = served.artifacts.get("mxfp4 export", checkpoint)
        say("gptoss's forward")
        t0 = time.perf_counter()
        refs = references(reference_ckpt, prompts, dtype=torch_dtype, greedy_tokens=options.greedy_tokens)
        timings["gptoss_forward"] = time.perf_counter() - t0
        max_len = max(len(r.ids) for r in refs) + options.greedy_tokens + 8
        say("starting the engine")
        engine = _engine(options, arch, max_len, served, dtype, timings, running)
        say("scoring")
        t0 = time.perf_counter()
        lora_kw = {"lora": served.adapter} if served.adapter else {}
        scores = engine.score([r.ids for r in refs], top_k=top_k, **lora_kw)
        if getattr(engine, "last_seconds", None) is not None:  # the engine's own prefill time (vLLM's generate call)
            timings["engine_prefill"] = engine.last_seconds
        from gptoss_cli.generate.engines.base import SamplingParams

        greedy = engine.generate([r.ids[:r.prompt_len] for r in refs],
                                 SamplingParams(max_tokens=max(options.greedy_tokens, 1)), **lora_kw) \
            if options.greedy_tokens else [None] * len(refs)
        timings["engine_score"] = time.perf_counter() - t0
        results = [compare_prompt(r, s, list(g.ids[:options.greedy_tokens]) if g else [])
                   for r, s, g in zip(refs, scores, greedy)]
        findings = known_findings(arch, _served_config(served.model), engine.info.name, engine.info.device)
        findings += _form_findings(served, options)
        info = engine.info.to_json()
        if any(r.verdict != "pass" for r in results) and engine is not running and hasattr(engine, "keep_log"):
            engine.keep_log()  # the engine's side of a failed check, for the user to read
            info["log"] = str(engine.log_path)
    finally:
        if engine is not None and engine is not running:
            engine.close()
        if options.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    timings["total"] = time.perf_counter() - t_start
    served_json = {"model": served.model, "form": served.form, "adapter": served.adapter,
                   "artifacts": served.artifacts if options.work_dir else {}, "top_k": top_k}
    model = (f"per position: 2*sqrt(2) * max_i(4 * sigma * ||w_i * h|| + u * |z_i|), u = "
             f"{'2**-24' if dtype == 'float32' else '2**-8'} ({dtype}); router near-ties excluded")
    return ServeReport(named, kind, dtype, served_json, info, model, results, findings,
                       {k: round(v, 3) for k, v in timings.items()}, notes=list(served.notes))


def _form_findings(served, options: ServeCheckOptions) -> list[ServeFinding]:
    from gptoss_cli.parity.serve.export import DEQUANTISED, MERGED_GPTOSS, MERGED_PEFT

    out = []
    if served.form == DEQUANTISED:
        out.append(ServeFinding("mxfp4_kernel", "the engine has no MXFP4 MoE kernel here (vLLM's need a GPU, or AMX "
                           "and amd-quark on CPUs): the MXFP4 export's dequantised layout was checked, not the "
                           "engine's MXFP4 kernel"))
    if served.form in (MERGED_PEFT, MERGED_GPTOSS) and options.lora != "merged":
        out.append(ServeFinding("lora_experts", "the engine cannot serve a PEFT adapter on the MoE experts here "
                           f"(vLLM's expert LoRA kernels are Triton GPU kernels): checked the {served.form}"))
    return out





# --- the end of a training run ------------------------------------------------------------------
REPORT_FILE = "serve_check.json"


def check_after_training(checkpoint: str, run_dir: str | Path, engine: str, engine_python: str | None,
                         dtype: str) -> tuple[ServeReport, Path]:
    """`train`'s `serve_check` section: the check of the final checkpoint, written to RUN_DIR/serve_check.json
    (whole or not at all) whatever the verdict; the caller decides what a failure does."""
    from gptoss_cli import outputs

    report = serve_check(checkpoint, ServeCheckOptions(engine=engine, engine_python=engine_python, dtype=dtype))
    path = Path(run_dir) / REPORT_FILE
    outputs.replace_text(path, json.dumps(report.to_json(), indent=2, default=str) + "\n")
    return report, path
__all__ = ["ServeCheckOptions", "serve_check", "check_after_training", "known_findings", "alternating", "ENGINES",
           "LORA_MODES", "REPORT_FILE"]
