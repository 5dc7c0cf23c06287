"""What `gptoss generate` needs around the decoding loop: the tokenizer, the stop tokens, prompts, the fit check, results.

Checkpoint kinds are the loaders' (gptoss_cli/checkpoint/load.py): HF, OpenAI original, Hybrid, a
training run or one of its iterations. The tokenizer is the checkpoint's `tokenizer.json` (for a
training run, that of the weights it started from) unless one is given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from gptoss_cli.checkpoint.sources import open_source, source_pattern
from gptoss_cli.data.tokenizer import TOKENIZER_FILE, read_tokenizer, tokenizer_path
from gptoss_cli.errors import CheckpointError, UsageError
from gptoss_cli.generate.decode import MAX_NEW_TOKENS, STOP_TOKEN, Generation, Sampling, generate_ids
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.dtypes import torch_dtype
from gptoss_cli.model.pattern import HybridPattern
from gptoss_cli.recipe.estimate.memory import size_text
from gptoss_cli.recipe.estimate.parameters import parameter_layout
from gptoss_cli.resources import available_memory_bytes
from gptoss_cli.json_input import jsonl_lines, strict_utf8

# The tokens that end an assistant's turn in the harmony format: a final answer, a tool call.
HARMONY_STOP_TOKENS = ("<|return|>", "<|call|>")
# Plain-text (--raw) generation also stops at the end-of-text token.
RAW_STOP_TOKENS = HARMONY_STOP_TOKENS + ("<|endoftext|>",)
GENERATE_DTYPES = ("float32", "bfloat16")  # generate's --dtype besides auto
# Of a device's memory, what the weights may take: the rest is the KV cache, activations, the allocator.
WEIGHTS_FRACTION = 0.9


@dataclass
class Checkpoint:
    """What opening a checkpoint for generation found, before any weights are read."""

    path: str
    kind: str
    arch: GptOssArch
    pattern: HybridPattern
    tokenizer_file: Path


def open_checkpoint(path: str, tokenizer: str | Path | None = None) -> Checkpoint:
    """The checkpoint's kind and architecture, and the tokenizer file to use (a checkpoint without
    tokenizer.json and no `tokenizer` is a UsageError saying so)."""
    source = open_source(str(path))
    try:
        kind, arch, pattern, extras = source.kind, source.arch, source_pattern(source), source.extras_folder
    finally:
        source.close()
    if tokenizer is not None:
        file = tokenizer_path(tokenizer)
        if not file.is_file():
            raise UsageError(f"--tokenizer {tokenizer}: {file} not found",
                             hint="pass a tokenizer.json or a folder holding one")
    else:
        file = Path(extras) / TOKENIZER_FILE
        if not file.is_file():
            raise UsageError(f"{path}: no {TOKENIZER_FILE} in {extras}",
                             hint="pass --tokenizer with the model's tokenizer.json "
                                  "(or the folder of the original checkpoint)")
    return Checkpoint(str(path), kind, arch, pattern, file)


def load_tokenizer(file: Path, vocab_size: int):
    """A `tokenizers.Tokenizer` from tokenizer.json, whose ids fit the model's vocabulary."""
    tok = read_tokenizer(file, "generate")
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise UsageError(f"{file}: tokenizer vocabulary {n} exceeds the model's vocab_size {vocab_size}",
                         hint="use the model's own tokenizer.json")
    return tok


def stop_token_ids(tok, names: Sequence[str]) -> list[int]:
    """The ids of those of `names` the tokenizer has (in order)."""
    ids = [tok.token_to_id(n) for n in names]
    return [i for i in ids if i is not None]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str) -> torch.device:
    """--device as torch reads it: a name torch does not know, or CUDA where there is none, is one line."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available here", hint="use --device cpu")
    return dev


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """"auto" is bfloat16 on an accelerator (as GPT-OSS is trained and shipped), float32 on CPUs; `device` is
    checked first, whatever the dtype."""
    dev = check_device(device)
    if name == "auto":
        return torch.float32 if dev.type == "cpu" else torch.bfloat16
    if name not in GENERATE_DTYPES:
        raise UsageError(f"--dtype {name!r} is not one of auto, {', '.join(GENERATE_DTYPES)}")
    return torch_dtype(name)


def device_memory(device: str) -> tuple[int, str]:
    """(bytes available on `device`, its description): free accelerator memory, or the host's available RAM."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: CUDA is not available here", hint="use --device cpu")
        free, _total = torch.cuda.mem_get_info(dev)
        return free, f"{device} ({torch.cuda.get_device_name(dev)}) has {size_text(free)} free"
    have = host_available_memory()
    return have, f"{device} has {size_text(have)} of available host memory"


def host_available_memory() -> int:
    """The host's available memory (Linux MemAvailable: free plus reclaimable caches), else its total RAM."""
    import os

    available = available_memory_bytes()
    if available is not None:
        return available
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def check_fits(arch: GptOssArch, pattern: HybridPattern, dtype: torch.dtype, device: str) -> int:
    """The weights' bytes in `dtype`; a UsageError saying what fits where when they do not fit `device`.

    One process holds the whole model (multi-process expert-parallel generation is not implemented)."""
    numel = sum(p.numel for p in parameter_layout(arch, pattern))
    need = numel * torch.empty((), dtype=dtype).element_size()
    have, where = device_memory(device)
    if need > WEIGHTS_FRACTION * have:
        raise UsageError(
            f"the model's {numel / 1e9:.1f}B parameters take {size_text(need)} in {str(dtype).removeprefix('torch.')}, "
            f"but {where}; generate runs the whole model in one process",
            hint="use a device with more memory (gpt-oss-20b needs about 42 GB in bfloat16, gpt-oss-120b about 234 GB); "
                 "expert-parallel generation over several processes is not implemented yet",
        )
    return need


class TextStream:
    """Decodes a growing list of ids to text incrementally: `push(id)` returns the new text that is
    complete (a multi-byte character split over tokens is held back until its last byte arrives).

    The ids of the current line are decoded together (a decoder may join tokens, e.g. with spaces);
    at a newline they are dropped, so the work per token stays the length of a line."""

    def __init__(self, tok):
        self.tok = tok
        self.ids: list[int] = []
        self.printed = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=False)
        if text.endswith("\ufffd") or not text.startswith(self.printed):
            return ""
        new, self.printed = text[len(self.printed):], text
        if text.endswith("\n"):
            self.ids, self.printed = [], ""
        return new


def read_prompts_file(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """A JSONL file of prompts: ("FILE:LINE", object) per non-empty line, each object a {"prompt": "..."}
    or a conversation ({"messages": [...]}, checked when it is rendered)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--prompts {path}: no such file")

    out = []
    for line in jsonl_lines(path, strict_utf8(path)):
        if line.blank:
            continue
        where, obj = f"{path}:{line.number}", line.value
        if not isinstance(obj, dict) or not (isinstance(obj.get("prompt"), str) or "messages" in obj):
            raise UsageError(f"{where}: neither a string field 'prompt' nor a conversation ('messages')",
                             hint='write one {"prompt": "..."} or {"messages": [...]} per line')
        if obj.get("prompt") == "":
            raise UsageError(f"{where}: the prompt is empty")
        out.append((where, obj))
    if not out:
        raise UsageError(f"--prompts {path}: holds no prompts")
    return out


@dataclass
class Reply:
    """One prompt's outcome, as shown and as written to --json."""

    prompt: str
    generation: Generation
    text: str
    seconds: float
    stop_token_text: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        n = len(self.generation.output_ids)
        return n / self.seconds if self.seconds > 0 else float("inf")

    def stop_text(self) -> str:
        g = self.generation
        if g.stop_reason == STOP_TOKEN:
            return f"stopped at {self.stop_token_text}"
        if g.stop_reason == MAX_NEW_TOKENS:
            return f"hit --max-new-tokens {len(g.output_ids)} before a stop token"
        return "not finished"

    def to_json(self) -> dict[str, Any]:
        g = self.generation
        return {"prompt": self.prompt, "prompt_ids": g.prompt_ids, "output_ids": g.output_ids, "text": self.text,
                "stop_reason": g.stop_reason, "stop_token": self.stop_token_text,
                "new_tokens": len(g.output_ids), "tokens_per_s": round(self.tokens_per_s, 3), **self.extra}


@dataclass
class Prompt:
    """One prompt to continue: how it is shown (`label`), its token ids, and for --json what it was made from."""

    label: str
    ids: list[int]
    source: dict[str, Any] = field(default_factory=dict)


def raw_prompt(tok, text: str) -> Prompt:
    """A plain-text prompt, tokenized as is (no special tokens added)."""
    ids = tok.encode(text, add_special_tokens=False).ids
    if not ids:
        raise UsageError(f"the prompt {text!r} encodes to no tokens")
    return Prompt(text, ids, {"prompt": text})


class RawReplies:
    """--raw: the reply is the decoded text of the new tokens (the stop token left out)."""

    def __init__(self, tok, stop_ids: Sequence[int]):
        self.tok, self.stops = tok, set(stop_ids)

    def streamer(self, write_out: Callable[[str], None], write_err: Callable[[str], None]) -> Callable[[int], None]:
        stream = TextStream(self.tok)

        def push(token_id: int) -> None:
            if token_id not in self.stops:
                text = stream.push(token_id)
                if text:
                    write_out(text)

        return push

    def describe(self, g: Generation) -> tuple[str, dict[str, Any]]:
        body = g.output_ids[:-1] if g.stop_reason == STOP_TOKEN else g.output_ids
        return self.tok.decode(body, skip_special_tokens=False), {}


def run_generation(model, tok, prompts: Sequence[Prompt], replies, *, max_new_tokens: int, stop_ids: Sequence[int],
                   sampling: Sampling, write_out: Callable[[str], None] | None = None,
                   write_err: Callable[[str], None] | None = None,
                   on_done: Callable[[int], None] | None = None) -> list[Reply]:
    """Generate `prompts` as one batch and decode each reply with `replies` (RawReplies or HarmonyReplies).

    With `write_out`, a single prompt's reply streams as its tokens come (`write_err` takes what is
    not the answer itself, e.g. the analysis channel). `on_done(row)` is called when a row finishes."""
    push = None
    if write_out is not None and len(prompts) == 1:
        push = replies.streamer(write_out, write_err or (lambda text: None))
    stops, counts = set(stop_ids), [0] * len(prompts)

    def show(row: int, token_id: int) -> None:
        if push is not None:
            push(token_id)
        counts[row] += 1
        if on_done is not None and (token_id in stops or counts[row] == max_new_tokens):
            on_done(row)

    # with nothing to show per token the loop reads nothing back per step
    on_token = None if push is None and on_done is None else show
    t0 = time.perf_counter()
    gens = generate_ids(model, [p.ids for p in prompts], max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                        sampling=sampling, on_token=on_token)
    seconds = time.perf_counter() - t0
    out = []
    for prompt, g in zip(prompts, gens):
        text, extra = replies.describe(g)
        stop = tok.id_to_token(g.stop_token) if g.stop_token is not None else None
        out.append(Reply(prompt.label, g, text, seconds, stop, {**prompt.source, **extra}))
    return out


def load_model(ckpt: Checkpoint, dtype: torch.dtype, device: str, progress: Callable[[str], None] | None = None):
    """The checkpoint's model in eval mode on `device`, after the fit check."""
    from gptoss_cli.checkpoint.load import model_from_checkpoint

    check_fits(ckpt.arch, ckpt.pattern, dtype, device)
    try:
        model = model_from_checkpoint(ckpt.path, dtype=dtype, device=device, progress=progress)
    except torch.cuda.OutOfMemoryError:
        raise CheckpointError(f"{ckpt.path}: out of {device} memory while loading the model",
                              hint="free the device or use one with more memory") from None
    return model.eval()
