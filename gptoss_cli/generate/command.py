"""`gptoss generate`'s library entry: check the options, open the checkpoint and its tokenizer, build the
prompts, load the model, generate, and the summary `--json` writes.

`generate(options, hooks)` is what the command calls; `GenerateHooks` carries what the terminal
shows while it runs (the tensor being loaded, the streamed reply, the rows that finished), so the
library never prints. The pieces it calls: session.py (checkpoint, tokenizer, fit check, the
batch), chat.py (harmony or raw prompts and replies), decode.py (the decoding loop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gptoss_cli.errors import UsageError

MIN_TEMPERATURE = 1e-6  # far from fp32 overflow of logits / temperature, far below any useful temperature
MAX_TEMPERATURE = 100.0
MAX_NEW_TOKENS_LIMIT = 1 << 20


@dataclass
class GenerateOptions:
    """What `gptoss generate` was asked (its options, by name)."""

    checkpoint: str
    prompt: str | None = None
    messages: Path | None = None
    prompts: Path | None = None
    system: str | None = None
    developer: str | None = None
    reasoning_effort: str | None = None
    raw: bool = False
    show_analysis: bool = False
    tokenizer: Path | None = None
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    device: str | None = None
    dtype: str = "auto"

    def check(self) -> None:
        """Refuse contradictory or out-of-range options (UsageError naming the option), before any file is read."""
        if sum(x is not None for x in (self.prompt, self.messages, self.prompts)) != 1:
            raise UsageError("give exactly one of --prompt TEXT, --messages FILE.json or --prompts FILE.jsonl")
        if self.prompt is not None and not self.prompt:
            raise UsageError("--prompt is empty")
        for name, text in (("--prompt", self.prompt), ("--system", self.system), ("--developer", self.developer)):
            try:
                (text or "").encode("utf-8")
            except UnicodeEncodeError as exc:  # a byte that is not UTF-8 in argv comes in as a lone surrogate
                raise UsageError(f"{name}: character {exc.start} is not valid UTF-8 text") from None
        if self.raw and (self.messages is not None or self.show_analysis):
            raise UsageError("--raw takes a plain-text --prompt or --prompts, not --messages or --show-analysis")
        if (self.raw or self.prompt is None and self.prompts is None) and any(
                x is not None for x in (self.system, self.developer, self.reasoning_effort)):
            raise UsageError("--system, --developer and --reasoning-effort go with a harmony --prompt or --prompts; "
                             "write them into the conversation of --messages")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise UsageError(f"--max-new-tokens {self.max_new_tokens} must be in [1, {MAX_NEW_TOKENS_LIMIT}]")
        # logits / temperature is fp32: below ~1e-38 it overflows to inf and the softmax turns NaN
        t = self.temperature
        if t != 0.0 and not (math.isfinite(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            raise UsageError(f"--temperature {t!r} must be 0 (greedy) or a finite number in "
                             f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise UsageError(f"--top-p {self.top_p!r} must be a finite number in (0, 1]")
        if not 0 <= self.seed < 1 << 63:
            raise UsageError(f"--seed {self.seed} must be in [0, 2**63)")


@dataclass
class GenerateHooks:
    """What the caller shows while `generate` runs; every hook is optional.

    loading(name): a tensor is being read. started(n): loading is over, n prompts start.
    write_out / write_err: a single prompt's reply as it streams (the answer; the rest).
    row_done(row): a prompt of a batch finished."""

    loading: Callable[[str], None] | None = None
    started: Callable[[int], None] | None = None
    write_out: Callable[[str], None] | None = None
    write_err: Callable[[str], None] | None = None
    row_done: Callable[[int], None] | None = None


@dataclass
class GenerateResult:
    """The replies of one `gptoss generate`, and what they were generated with (`to_json`: the --json file)."""

    options: GenerateOptions
    kind: str
    tokenizer: str
    device: str
    dtype: str
    greedy: bool
    stop_ids: list[int]
    replies: list[Any] = field(default_factory=list)  # session.Reply

    def to_json(self) -> dict[str, Any]:
        o = self.options
        return {
            "checkpoint": o.checkpoint, "kind": self.kind, "tokenizer": self.tokenizer,
            "mode": "raw" if o.raw else "harmony", "device": self.device, "dtype": self.dtype,
            "sampling": {"temperature": o.temperature, "top_p": o.top_p, "seed": o.seed, "greedy": self.greedy},
            "max_new_tokens": o.max_new_tokens, "stop_token_ids": self.stop_ids,
            "replies": [r.to_json() for r in self.replies],
        }


def generate(options: GenerateOptions, hooks: GenerateHooks | None = None) -> GenerateResult:
    """Check `options`, then everything `gptoss generate` does up to the replies (see the module docstring)."""
    from gptoss_cli.generate.chat import prepare_prompts
    from gptoss_cli.generate.decode import Sampling
    from gptoss_cli.generate.session import (
        default_device, load_model, load_tokenizer, open_checkpoint, resolve_dtype, run_generation,
    )

    hooks = hooks or GenerateHooks()
    options.check()
    device = options.device or default_device()
    dtype = resolve_dtype(options.dtype, device)
    ckpt = open_checkpoint(options.checkpoint, options.tokenizer)
    tok = load_tokenizer(ckpt.tokenizer_file, ckpt.arch.vocab_size)
    items, replies, stop_ids = prepare_prompts(
        tok, str(ckpt.tokenizer_file), raw=options.raw, prompt=options.prompt, messages=options.messages,
        prompts=options.prompts, system=options.system, developer=options.developer,
        reasoning_effort=options.reasoning_effort, show_analysis=options.show_analysis,
    )
    model = load_model(ckpt, dtype, device, progress=hooks.loading)
    if hooks.started is not None:
        hooks.started(len(items))
    sampling = Sampling(temperature=options.temperature, top_p=options.top_p, seed=options.seed)
    results = run_generation(model, tok, items, replies, max_new_tokens=options.max_new_tokens, stop_ids=stop_ids,
                             sampling=sampling, write_out=hooks.write_out, write_err=hooks.write_err,
                             on_done=hooks.row_done)
    return GenerateResult(options, ckpt.kind, str(ckpt.tokenizer_file), device, str(dtype).removeprefix("torch."),
                          sampling.greedy, list(stop_ids), results)


__all__ = ["GenerateOptions", "GenerateHooks", "GenerateResult", "generate"]
