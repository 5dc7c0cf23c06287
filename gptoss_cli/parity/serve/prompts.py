"""The token ids serve-check scores: a conversations file, or built-in prompts.

A `--prompts` file is JSONL, one prompt per line: a conversation in the SFT data's form
({"messages": [...]}, rendered in harmony with the checkpoint's tokenizer as training renders it,
earlier exchanges' analysis dropped) or raw ids ({"prompt_ids": [...]}, for a model without a
tokenizer). Built in: with a harmony tokenizer, a one-turn conversation longer than the sliding
window and a multi-turn one whose earlier analysis is dropped; without one, token-id prompts, the
first longer than twice the window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptoss_cli.errors import UsageError
from gptoss_cli.model.config import GptOssArch

LONG_TEXT = ("The sliding window covers the most recent tokens only, so a prompt longer than it checks that the "
             "engine masks the older keys exactly where the trainer did. ")


def _conversations(window: int) -> list[tuple[str, dict[str, Any]]]:
    repeats = max(2, window // 20 + 2)
    long_user = " ".join(f"Point {i}: {LONG_TEXT}" for i in range(repeats))
    one_turn = {"messages": [
        {"role": "user", "content": long_user + "Summarise the points in one sentence."},
        {"role": "assistant", "thinking": "The user wants one sentence.", "content": "Each point is the same."},
    ]}
    multi_turn = {"messages": [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "thinking": "Add two and two.", "content": "4"},
        {"role": "user", "content": "And times three?"},
        {"role": "assistant", "thinking": "Four times three is twelve.", "content": "12"},
    ]}
    return [("long (one turn, past the window)", one_turn), ("multi-turn (earlier analysis dropped)", multi_turn)]


def id_prompts(arch: GptOssArch, seed: int = 0) -> list[tuple[str, list[int]]]:
    """Token-id prompts for a model without a tokenizer: one of 2 * window + 17 ids, one of 12."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    long = 2 * arch.sliding_window + 17
    return [(f"ids x{long} (past the window)", torch.randint(0, arch.vocab_size, (long,), generator=gen).tolist()),
            ("ids x12", torch.randint(0, arch.vocab_size, (12,), generator=gen).tolist())]


def _render(tok, conv: Any, where: str) -> list[int]:
    from gptoss_cli.data.conversation import parse_conversation
    from gptoss_cli.data.harmony import ConversationError, render_for_training

    try:
        return render_for_training(parse_conversation(conv), tok).ids
    except (ConversationError, ValueError) as exc:
        raise UsageError(f"{where}: {exc}") from None


def harmony_tokenizer_for(tokenizer_file: Path | None, vocab_size: int):
    """The harmony tokenizer of `tokenizer_file`, or None when there is none or it lacks harmony's tokens."""
    if tokenizer_file is None or not Path(tokenizer_file).is_file():
        return None
    from gptoss_cli.data.harmony import ConversationError, HarmonyTokenizer
    from gptoss_cli.data.tokenizer import read_tokenizer

    tok = read_tokenizer(tokenizer_file, "serve-check")
    if tok.get_vocab_size(with_added_tokens=True) > vocab_size:
        return None
    try:
        return HarmonyTokenizer(tok, str(tokenizer_file))
    except ConversationError:
        return None


def load_prompts(arch: GptOssArch, prompts_file: Path | None, tokenizer_file: Path | None) -> list[tuple[str, list[int]]]:
    """(name, ids) of every prompt to score; ids are checked against the vocabulary."""

    htok = harmony_tokenizer_for(tokenizer_file, arch.vocab_size)
    out: list[tuple[str, list[int]]] = []
    if prompts_file is None:
        if htok is None:
            out = id_prompts(arch)
        else:
            out = [(name, _render(htok, conv, name)) for name, conv in _conversations(arch.sliding_window)]
    else:
        out = [_file_prompt(where, obj, htok) for where, obj in _read_lines(Path(prompts_file))]
    for name, ids in out:
        bad = [t for t in ids if not 0 <= t < arch.vocab_size]
        if bad:
            raise UsageError(f"{name}: token id {bad[0]} is outside the model's vocabulary of {arch.vocab_size}")
        if len(ids) < 2:
            raise UsageError(f"{name}: a prompt needs at least 2 tokens to score")
    return out


def _read_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    from gptoss_cli.json_input import jsonl_lines, strict_utf8

    if not path.is_file():
        raise UsageError(f"--prompts {path}: no such file")

    lines = [(f"{path}:{line.number}", line.value) for line in jsonl_lines(path, strict_utf8(path))
             if not line.blank]
    if not lines:
        raise UsageError(f"--prompts {path}: holds no prompts")
    return lines


def _file_prompt(where: str, obj: Any, htok) -> tuple[str, list[int]]:
    if isinstance(obj, dict) and "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise UsageError(f"{where}: prompt_ids must be a list of integers")
        return where, ids
    if isinstance(obj, dict) and "messages" in obj:
        if htok is None:
            raise UsageError(f"{where}: a conversation needs the checkpoint's harmony tokenizer.json, and there is none",
                             hint='give token ids instead: {"prompt_ids": [...]}')
        return where, _render(htok, obj, where)
    raise UsageError(f"{where}: neither a conversation ('messages') nor 'prompt_ids'",
                     hint='write one {"messages": [...]} or {"prompt_ids": [...]} per line')


__all__ = ["load_prompts", "id_prompts", "harmony_tokenizer_for"]
