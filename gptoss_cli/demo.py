"""`gptoss demo`: the whole job in one command, on a built-in tiny GPT-OSS, with no GPU and no network.

Stages, in order, each calling the same library function as its own command:
  1. convert   a deterministic tiny GPT-OSS with MXFP4 experts (make-tiny) -> Hybrid;
  2. parity    weights, then block-by-block logits against transformers (skipped without it);
  3. validate  the tiny EP=2 overlap recipe (must pass) and a production recipe that must be
               rejected, with the message a user would get;
  4. train     2 local processes, EP=2, the overlap schedule and delayed wgrad, from the converted
               checkpoint, on learnable data (a fixed permutation cycle: each token determines the
               next, so the loss must fall);
  5. sft       supervised fine-tuning offline: built-in conversations through prepare-data's harmony
               rendering with the tokenizer make-tiny wrote, a short run from the converted checkpoint
               with validation on held-out conversations, eval of the result (the same held-out loss),
               and one generated reply (skipped without the `tokenizers` package, `.[data]`);
  6. export    the training checkpoint -> HF with MXFP4 experts, reloaded (by our loader, and by
               transformers when installed): its next-token predictions on a prompt against the
               trained model's.
A stage whose input is missing (an earlier stage failed) is not run. The library reports, the CLI
renders (gptoss_cli/cli/demo.py); `DemoResult.skipped` names the skipped stages and why.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from gptoss_cli.errors import GptossError, UsageError

if TYPE_CHECKING:
    from gptoss_cli.train.progress import TrainProgress

MARKER = ".gptoss-demo"  # a folder holding it is a demo workdir, which the demo may overwrite
RECIPE = "tiny_cpu_ep2_overlap"
REJECTED_RECIPE = "gb200_fp8mx"  # MXFP8 + full-iteration CUDA graphs + EP overlap: Megatron's policy rejects it
DEFAULT_STEPS = 30
# Demo training: a larger lr than the recipe's 1e-3 so the loss visibly falls in a few dozen steps.
DEMO_LR = 1.0e-2
CYCLE = 97  # tokens in the learnable permutation cycle
PROMPT_TOKENS = 24
PASSED, FAILED, SKIPPED, NOT_RUN = "passed", "failed", "skipped", "not run"


@dataclass
class StageResult:
    name: str
    status: str  # passed | failed | skipped | not run
    summary: str  # one line
    seconds: float = 0.0
    figure: str = ""  # the stage's key figure, as text
    lines: list[str] = field(default_factory=list)  # what the stage shows the user beyond its summary
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class DemoResult:
    workdir: str
    steps: int
    stages: list[StageResult]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(s.status in (PASSED, SKIPPED) for s in self.stages)

    @property
    def skipped(self) -> list[StageResult]:
        return [s for s in self.stages if s.status == SKIPPED]

    def to_dict(self) -> dict[str, Any]:
        return {"workdir": self.workdir, "steps": self.steps, "ok": self.ok, "seconds": self.seconds,
                "stages": [asdict(s) for s in self.stages]}


class DemoHooks(Protocol):
    """What the CLI provides: a stage header, a convert progress, a train progress callback."""

    def stage(self, index: int, name: str, what: str) -> None: ...
    def convert_progress(self, label: str) -> Any: ...  # a context manager implementing convert's ConvertProgress
    def train_progress(self) -> TrainProgress | None: ...
    def result(self, stage: StageResult) -> None: ...


def prepare_workdir(workdir: str | Path | None) -> Path:
    """The demo's folder: new (a fresh temporary folder by default) or one an earlier demo made."""
    if workdir is None:
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="gptoss-demo-"))
    else:
        folder = Path(workdir).expanduser()
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"--workdir {folder}: is a file, not a folder")
        if folder.is_dir() and any(folder.iterdir()) and not (folder / MARKER).is_file():
            raise UsageError(f"--workdir {folder}: is not empty and was not made by `gptoss demo`",
                             hint="choose a new or empty folder; the demo overwrites only its own workdir")
        folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text("made by gptoss demo; its contents are replaced by the next demo run\n")
    for name in ("hf", "hybrid", "data", "train", "sft", "export"):  # an earlier demo's outputs
        shutil.rmtree(folder / name, ignore_errors=True)
    return folder.resolve()


def learnable_tokens(arch: Any, n_tokens: int, seed: int = 0) -> "Any":
    """A fixed permutation cycle over CYCLE token ids: token t is always followed by next[t]."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(min(arch.vocab_size - 2, 1000), generator=gen)[:CYCLE]  # skip pad and EOS
    return ids.repeat(n_tokens // CYCLE + 1)[:n_tokens]


def write_token_file(prefix: Path, tokens: Any, vocab_size: int, eos_token_id: int | None) -> None:
    """The token format of `gptoss prepare-data` (gptoss_cli/data/token_format.py), one document."""
    import torch

    from gptoss_cli.data.token_format import token_dtype_for, token_file_paths, write_token_header

    dtype = token_dtype_for(vocab_size)
    bin_path, json_path = token_file_paths(prefix)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    bin_path.write_bytes(tokens.to(torch.int32).numpy().astype(dtype).tobytes())
    write_token_header(json_path, dtype=dtype, num_tokens=int(tokens.numel()), num_documents=1, vocab_size=vocab_size,
                       eos_token_id=eos_token_id, tokenizer=None, sources=["gptoss demo: a permutation cycle"])


def _transformers_available() -> bool:
    """Whether transformers (with its GPT-OSS model) is installed, as parity-check requires it; if so
    it is imported here, with the load-time warnings of optional kernels it probes (torchao's CUDA
    libraries, pytree registrations) kept out of the demo."""
    import importlib
    import logging

    from gptoss_cli.parity.check import require_transformers

    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        require_transformers()
        importlib.import_module("transformers.integrations.mxfp4")  # the import that probes the kernels
    except UsageError:  # not installed: the stages that need it are skipped
        return False
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return True


class _Runner:
    def __init__(self, hooks: DemoHooks):
        self.hooks = hooks
        self.stages: list[StageResult] = []

    def run(self, name: str, what: str, fn: Callable[[], StageResult], needs: tuple[str, ...] = ()) -> StageResult:
        self.hooks.stage(len(self.stages) + 1, name, what)
        failed = [s.name for s in self.stages if s.name in needs and s.status not in (PASSED, SKIPPED)]
        t0 = time.perf_counter()
        if failed:
            res = StageResult(name, NOT_RUN, f"needs {', '.join(failed)}, which did not pass")
        else:
            try:
                res = fn()
            except GptossError as exc:
                res = StageResult(name, FAILED, str(exc).splitlines()[0])
            except Exception as exc:  # a bug or a broken install: this stage fails, the demo goes on
                import traceback

                first = (str(exc).strip().splitlines() or [""])[0]
                res = StageResult(name, FAILED, f"{type(exc).__name__}: {first}",
                                  details={"traceback": traceback.format_exc()})
        res.seconds = time.perf_counter() - t0
        self.stages.append(res)
        self.hooks.result(res)
        return res


def run_demo(workdir: str | Path | None = None, steps: int = DEFAULT_STEPS, *, hooks: DemoHooks) -> DemoResult:
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 10_000:
        raise UsageError(f"--steps {steps!r} must be an integer from 1 to 10000")
    t0 = time.perf_counter()
    folder = prepare_workdir(workdir)
    hf, hybrid, data, run_dir, export = (folder / n for n in ("hf", "hybrid", "data/cycle", "train", "export"))
    r = _Runner(hooks)
    r.run("convert", "tiny GPT-OSS (MXFP4 experts) -> Hybrid", lambda: _convert(hooks, hf, hybrid))
    r.run("parity", "weights, then block-by-block logits against transformers",
          lambda: _parity(hf, hybrid), needs=("convert",))
    r.run("validate", f"{RECIPE} (must pass) and {REJECTED_RECIPE} (must be rejected)", _validate)
    r.run("train", f"{steps} steps, 2 processes, EP=2, overlap + delayed wgrad, from the converted checkpoint",
          lambda: _train(hooks, hybrid, data, run_dir, steps), needs=("convert", "validate"))
    r.run("sft", "harmony conversations -> prepare-data -> fine-tune with validation -> eval -> generate, offline",
          lambda: _sft(hooks, hf, hybrid, folder / "sft"), needs=("convert", "validate"))
    r.run("export", "training checkpoint -> HF (MXFP4 experts), reloaded: next-token predictions",
          lambda: _export(hooks, run_dir / "checkpoints", export), needs=("train",))
    return DemoResult(str(folder), steps, r.stages, time.perf_counter() - t0)


def _convert(hooks: DemoHooks, hf: Path, hybrid: Path) -> StageResult:
    from gptoss_cli.checkpoint.convert import convert
    from gptoss_cli.checkpoint.make_tiny import make_tiny

    make_tiny(hf, experts="mxfp4", seed=0)
    with hooks.convert_progress("converting") as progress:
        res = convert(str(hf), hybrid, progress=progress)
    rate = res.throughput_bytes_per_s
    return StageResult("convert", PASSED,
                       f"{res.num_tensors} tensors, {res.bytes_written / 2**20:.1f} MiB in {res.num_shards} shard(s), "
                       f"experts {res.experts_in} -> {res.experts_out}",
                       figure=f"{rate / 2**20:.1f} MiB/s",
                       details={"hf": str(hf), "hybrid": str(hybrid), "bytes_per_s": rate, "tensors": res.num_tensors})


def _parity(hf: Path, hybrid: Path) -> StageResult:
    if not _transformers_available():
        return StageResult("parity", SKIPPED, "install .[parity] (transformers) to compare against it",
                           figure="-")
    from gptoss_cli.parity.check import run_parity

    report = run_parity(hf, hybrid)
    logits = report.logits
    details = {"weights_checked": report.weights.tensors_checked if report.weights else 0,
               "weights_passed": report.weights is None or report.weights.passed,
               "blocks": [asdict(s) for s in report.stages], "logits": asdict(logits) if logits else None}
    return StageResult("parity", PASSED if report.passed else FAILED, report.summary(),
                       figure=f"max |logit diff| {logits.max_abs_diff:.2e}" if logits else "-", details=details)


def _validate() -> StageResult:
    from gptoss_cli.recipe.load import load_recipe
    from gptoss_cli.recipe.validate import validate_recipe

    good = validate_recipe(load_recipe(RECIPE))
    bad = validate_recipe(load_recipe(REJECTED_RECIPE))
    details = {"valid": {"recipe": RECIPE, "verdict": good.verdict},
               "rejected": {"recipe": REJECTED_RECIPE, "verdict": bad.verdict,
                            "errors": [{"rule": f.rule, "message": f.message, "hint": f.hint} for f in bad.errors]}}
    if not good.ok:
        return StageResult("validate", FAILED, f"{RECIPE} should be valid: {good.verdict}", details=details)
    if bad.ok:
        return StageResult("validate", FAILED, f"{REJECTED_RECIPE} should be rejected: {bad.verdict}", details=details)
    rules = ", ".join(f.rule for f in bad.errors)
    lines = [good.verdict, bad.verdict]
    for f in bad.errors:
        lines.append(f"  error [{f.rule}] {f.message}" + (f" Fix: {f.hint}" if f.hint else ""))
    return StageResult("validate", PASSED, f"{RECIPE} valid; {REJECTED_RECIPE} rejected by {rules}",
                       figure=f"{len(bad.errors)} error(s) in {REJECTED_RECIPE}", lines=lines, details=details)


def _train(hooks: DemoHooks, hybrid: Path, data: Path, run_dir: Path, steps: int) -> StageResult:
    from gptoss_cli.checkpoint.load import checkpoint_architecture
    from gptoss_cli.recipe.load import load_recipe
    from gptoss_cli.run.launch import train

    arch, _ = checkpoint_architecture(hybrid)
    cfg_tokens = 8 * 32  # global batch x seq_length of the tiny recipe
    write_token_file(data, learnable_tokens(arch, steps * cfg_tokens + 1), arch.vocab_size, arch.eos_token_id)
    recipe = load_recipe(RECIPE, [
        "model.preset=null", f"model.checkpoint={hybrid}", f"checkpoint.pretrained={hybrid}",
        "data.kind=tokens", f"data.path={data}", f"training.train_iters={steps}", f"training.lr={DEMO_LR}",
        f"training.min_lr={DEMO_LR / 10}", f"checkpoint.dir={run_dir / 'checkpoints'}", "checkpoint.save_interval=null",
        "checkpoint.resume=false", f"logging.run_dir={run_dir}",
    ])
    res = train(recipe, progress=hooks.train_progress())
    first, last = res.losses[0], res.losses[-1]
    # a visible fall: at least a tenth of the starting loss (the cycle is learnable to ~0)
    status = PASSED if last < 0.9 * first else FAILED
    return StageResult("train", status,
                       f"loss {first:.3f} -> {last:.3f} in {res.steps} steps (world {res.world_size}, EP {res.ep_size}, "
                       f"overlap + delayed wgrad)" + ("" if status == PASSED else "; the loss did not fall by 10%"),
                       figure=f"{res.tokens_per_s:.0f} tokens/s",
                       details={"losses": res.losses, "tokens_per_s": res.tokens_per_s, "checkpoint": res.checkpoint})


SFT_STEPS = 12
SFT_SEQ = 160  # a row holds one conversation (about 130 tokens with harmony's system message)


def sft_conversations(held_out: bool) -> list[dict[str, Any]]:
    """Short arithmetic exchanges in the Hugging Face form prepare-data reads (held-out: other numbers)."""
    pairs = [(a, b) for a in range(2, 9) for b in range(1, 5)]
    chosen = pairs[-4:] if held_out else pairs[:-4]
    return [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                          {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]} for a, b in chosen]


def preference_pairs(held_out: bool) -> list[dict[str, Any]]:
    """Preference pairs a tiny model learns in a few steps (docs/dpo.md): the same arithmetic answer on both
    sides, the chosen one ending in " Thanks", the rejected one in " please" (held-out: other numbers). Harmony's
    JSON form without a system message, so that a pair is about 40 tiny-tokenizer tokens."""
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    chosen = pairs[-12:] if held_out else pairs[:-12]
    return [{"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
             "chosen": [{"role": "assistant", "channel": "final", "content": f"{a + b}. Thanks"}],
             "rejected": [{"role": "assistant", "channel": "final", "content": f"{a + b}. please"}]}
            for a, b in chosen]


def _tokenizers_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tokenizers") is not None


def _sft(hooks: DemoHooks, hf: Path, hybrid: Path, folder: Path) -> StageResult:
    if not _tokenizers_available():
        return StageResult("sft", SKIPPED, "install .[data] (the tokenizers package) for prepare-data", figure="-")
    import json

    from gptoss_cli.data.prepare.conversations import prepare_conversations
    from gptoss_cli.recipe.load import load_recipe
    from gptoss_cli.train.evaluate import evaluate
    from gptoss_cli.run.launch import train

    folder.mkdir(parents=True, exist_ok=True)
    for name, held_out in (("train", False), ("val", True)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(c) + "\n" for c in sft_conversations(held_out)))
        prepare_conversations([folder / f"{name}.jsonl"], folder / name, hf, seq_length=SFT_SEQ)
    before = evaluate(hybrid, folder / "val", seq_length=SFT_SEQ)
    recipe = load_recipe(RECIPE, [
        "model.preset=null", f"model.checkpoint={hybrid}", f"checkpoint.pretrained={hybrid}",
        "parallelism.world_size=1", "parallelism.expert_model_parallel_size=1", "precision.params_dtype=fp32",
        "overlap.overlap_moe_expert_parallel_comm=false", "overlap.delay_wgrad_compute=false",
        "data.kind=tokens", f"data.path={folder / 'train'}", f"validation.data={folder / 'val'}",
        f"training.seq_length={SFT_SEQ}", "training.micro_batch_size=1", "training.global_batch_size=4",
        f"training.train_iters={SFT_STEPS}", f"training.lr={DEMO_LR}", f"training.min_lr={DEMO_LR / 10}",
        f"checkpoint.dir={folder / 'checkpoints'}", "checkpoint.save_interval=null", "checkpoint.resume=false",
        f"logging.run_dir={folder / 'run'}",
    ])
    res = train(recipe, nproc_per_node=1, progress=hooks.train_progress())
    after = evaluate(res.checkpoint, folder / "val", seq_length=SFT_SEQ)
    val = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()][-1]["val_loss"]
    reply = _sft_reply(res.checkpoint, hf)
    fell = after.loss < 0.9 * before.loss
    status = PASSED if fell and abs(val - after.loss) <= 1e-4 * abs(after.loss) else FAILED
    lines = [f"trained tokens: {res.steps} steps on {folder / 'train'} (harmony, loss on the assistant's tokens)",
             f"eval {res.checkpoint}: held-out loss {after.loss:.4f} (validation logged {val:.4f})",
             f"generate 'What is 7 plus 3?': {reply}"]
    return StageResult("sft", status,
                       f"held-out loss {before.loss:.3f} -> {after.loss:.3f} after {res.steps} steps"
                       + ("" if fell else "; it did not fall by 10%"),
                       figure=f"held-out loss {after.loss:.3f}", lines=lines,
                       details={"before": before.loss, "after": after.loss, "validation": val, "reply": reply,
                                "losses": res.losses, "checkpoint": res.checkpoint})


def _sft_reply(checkpoint: str, tokenizer: Path) -> str:
    """The fine-tuned model's greedy reply to a held-out question: its final channel, or the raw text
    with a note when it is not harmony."""
    import torch

    from gptoss_cli.generate.chat import prepare_prompts
    from gptoss_cli.generate.decode import Sampling
    from gptoss_cli.generate.session import load_model, load_tokenizer, open_checkpoint, run_generation

    ckpt = open_checkpoint(checkpoint, tokenizer)
    tok = load_tokenizer(ckpt.tokenizer_file, ckpt.arch.vocab_size)
    items, replies, stops = prepare_prompts(tok, str(ckpt.tokenizer_file), raw=False, prompt="What is 7 plus 3?")
    model = load_model(ckpt, torch.float32, "cpu")
    (r,) = run_generation(model, tok, items, replies, max_new_tokens=24, stop_ids=stops, sampling=Sampling())
    if r.text:
        return repr(r.text)
    return f"(not harmony yet) {r.extra.get('raw_text', '')!r}"


def _export(hooks: DemoHooks, checkpoints: Path, export: Path) -> StageResult:
    import torch

    from gptoss_cli.checkpoint.convert import convert
    from gptoss_cli.checkpoint.load import model_from_checkpoint

    with hooks.convert_progress("exporting") as progress:
        res = convert(str(checkpoints), export, to="hf", experts="mxfp4", dtype="float32", progress=progress)
    trained = model_from_checkpoint(checkpoints)  # the run's own record: architecture and layer pattern
    exported = model_from_checkpoint(export)
    arch = exported.arch
    prompt = learnable_tokens(arch, PROMPT_TOKENS).view(1, -1)  # the start of the training data
    with torch.no_grad():
        ours = trained(prompt).logits[0]
        theirs = exported(prompt).logits[0]
    top_ours, top_exp = ours.argmax(-1), theirs.argmax(-1)
    agree = int((top_ours == top_exp).sum())
    details = {"hf": str(export), "positions": PROMPT_TOKENS, "top1_agree": agree,
               "max_abs_logit_diff": float((ours - theirs).abs().max()),
               "predictions": top_ours.tolist(), "exported_predictions": top_exp.tolist()}
    reloaded, figure = "our loader", f"max |logit diff| vs trained {details['max_abs_logit_diff']:.2g} (MXFP4)"
    if _transformers_available():
        ref = _transformers_logits(export, prompt)
        agree_hf = int((ref.argmax(-1) == top_ours).sum())
        same_weights = float((ref - theirs).abs().max())  # two implementations, the same exported weights
        details.update(transformers_top1_agree=agree_hf, transformers_vs_ours_on_export_max_abs_logit_diff=same_weights)
        agree = min(agree, agree_hf)
        reloaded = "our loader and transformers"
        figure += f"; transformers vs ours {same_weights:.1g}"
    lines = [f"prompt (the start of the training data): {prompt[0].tolist()}",
             f"trained model's next tokens:  {top_ours.tolist()}",
             f"exported model's next tokens: {top_exp.tolist()}"]
    status = PASSED if agree == PROMPT_TOKENS else FAILED
    return StageResult("export", status,
                       f"{res.bytes_written / 2**20:.1f} MiB HF checkpoint (MXFP4 experts) at {export}, reloaded by "
                       f"{reloaded}: same next token at {agree}/{PROMPT_TOKENS} prompt positions",
                       figure=figure, lines=lines, details=details)


def _transformers_logits(folder: Path, prompt: "Any") -> "Any":
    """transformers' own loading of an MXFP4 export (dequantised on CPU), quietly, fp32."""
    import torch

    from gptoss_cli.parity.reference import load_transformers_model

    model = load_transformers_model(folder, torch.float32)
    with torch.no_grad():
        return model(prompt).logits[0]


__all__ = ["run_demo", "sft_conversations", "DemoResult", "StageResult", "DemoHooks", "prepare_workdir", "learnable_tokens",
           "write_token_file", "DEFAULT_STEPS", "PASSED", "FAILED", "SKIPPED", "NOT_RUN"]
