"""The prompts of a GRPO run: harmony conversations read once, rendered once, served in a resumable order.

`rl.prompts` is a JSONL file, one record per line, in the SFT data's forms (gptoss_cli/data/harmony.py):
`{"messages": [...]}` (harmony's or the Hugging Face chat form) or `{"prompt": "..."}` (one user turn,
as `gptoss generate --prompts` takes it). The conversation ends before the assistant's turn: the
prompt is its render for completion (through `<|start|>assistant`). Every other field of the record
(`answer`, test cases, ...) travels to the reward untouched. `builtin:arithmetic` generates sums with
their answers instead of reading a file.

Order: epoch by epoch, each epoch a permutation of the records seeded with (seed, epoch), the same on
every rank; the rollout of global index r takes prompts [r*P, (r+1)*P) of that endless stream (P
prompts per rollout), data-parallel rank d the contiguous slice d of them. The position (rollouts
done) is what a checkpoint saves. Torch-free.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from gptoss_cli.data.conversation import parse_conversation
from gptoss_cli.data.harmony import ConversationError, HarmonyTokenizer, render_prompt
from gptoss_cli.errors import ConfigError
from gptoss_cli.json_input import jsonl_lines, strict_utf8

BUILTIN = "builtin:"
BUILTIN_SETS = ("arithmetic",)
ARITHMETIC_PROMPTS = 256


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: where it came from (FILE:LINE), the record as read, its conversation and its token ids."""

    where: str
    record: dict[str, Any]
    messages: list[Any]
    ids: tuple[int, ...]


def arithmetic_records(n: int = ARITHMETIC_PROMPTS, seed: int = 0) -> list[dict[str, Any]]:
    """`builtin:arithmetic`: "What is a + b?" for seeded a, b in [0, 50), with `answer` the sum as text."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(50), rng.randrange(50)
        out.append({"messages": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
                    "answer": str(a + b)})
    return out


def _conversation(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: a prompt is a JSON object, got {type(obj).__name__}",
                          hint='write one {"messages": [...]} or {"prompt": "..."} per line')
    if "messages" in obj:
        return obj
    if isinstance(obj.get("prompt"), str) and obj["prompt"]:
        return {**{k: v for k, v in obj.items() if k != "prompt"},
                "messages": [{"role": "user", "content": obj["prompt"]}]}
    raise ConfigError(f"{where}: neither a conversation ('messages') nor a non-empty string field 'prompt'",
                      hint='write one {"messages": [...]} or {"prompt": "..."} per line')


def read_records(path: str) -> list[tuple[str, dict[str, Any]]]:
    """(FILE:LINE, record) of every non-blank line of `path`, or the built-in set it names."""
    if path.startswith(BUILTIN):
        name = path[len(BUILTIN):]
        if name not in BUILTIN_SETS:
            raise ConfigError(f"rl.prompts={path!r}: no such built-in prompt set",
                              hint=f"one of {', '.join(BUILTIN + s for s in BUILTIN_SETS)}, or a JSONL file")
        return [(f"{path}#{i}", r) for i, r in enumerate(arithmetic_records())]
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"rl.prompts={path}: no such file", hint="a JSONL file of conversations, one per line")

    out = [(f"{path}:{line.number}", line.value) for line in jsonl_lines(file, strict_utf8(path, ConfigError))
           if not line.blank]
    if not out:
        raise ConfigError(f"rl.prompts={path}: holds no prompts")
    return out


def render_records(records: Sequence[tuple[str, dict[str, Any]]], tok: HarmonyTokenizer, *,
                   max_prompt_tokens: int) -> list[PromptRecord]:
    """Each record's conversation rendered for completion; one that cannot be rendered, that already
    holds the assistant's answer, or whose prompt leaves fewer than the completion's tokens in a row
    (`max_prompt_tokens`: training.seq_length - rl.max_new_tokens) is a ConfigError naming FILE:LINE."""
    out = []
    for where, obj in records:
        conv = _conversation(obj, where)
        try:
            messages = parse_conversation(conv)
        except ConversationError as exc:
            raise ConfigError(f"{where}: {exc}", hint='a conversation is {"messages": [{"role": ..., "content": ...}]}') from None
        if messages and messages[-1].role == "assistant":
            raise ConfigError(f"{where}: the conversation ends with an assistant message; a prompt ends before the "
                              "assistant's turn", hint="drop the answer from messages (keep it as a field, e.g. "
                              "'answer', for the reward)")
        ids = render_prompt(messages, tok)
        if len(ids) > max_prompt_tokens:
            raise ConfigError(f"{where}: the prompt is {len(ids)} tokens; with rl.max_new_tokens it does not fit "
                              f"training.seq_length ({max_prompt_tokens} tokens left for the prompt)",
                              hint="raise training.seq_length, lower rl.max_new_tokens, or shorten the prompt")
        record = {k: v for k, v in conv.items() if k != "messages"}
        out.append(PromptRecord(where, record, list(conv["messages"]), tuple(ids)))
    return out


class PromptOrder:
    """The endless, seeded order of the prompts (see the module docstring)."""

    def __init__(self, num_prompts: int, seed: int):
        self.num_prompts, self.seed = num_prompts, seed
        self._epoch, self._perm = -1, list(range(num_prompts))

    def index(self, k: int) -> int:
        """The prompt at position k of the stream."""
        epoch, i = divmod(k, self.num_prompts)
        if epoch != self._epoch:
            self._perm = list(range(self.num_prompts))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._perm)
            self._epoch = epoch
        return self._perm[i]

    def rank_slice(self, rollout: int, per_rollout: int, dp_rank: int, dp_size: int) -> list[int]:
        """Prompt indices data-parallel rank `dp_rank` samples in rollout `rollout` (0-based)."""
        per_rank = per_rollout // dp_size
        start = rollout * per_rollout + dp_rank * per_rank
        return [self.index(k) for k in range(start, start + per_rank)]


__all__ = ["PromptRecord", "PromptOrder", "read_records", "render_records", "arithmetic_records", "BUILTIN",
           "BUILTIN_SETS"]
