"""Preference pairs: a dataset row read as a prompt with a chosen and a rejected reply, both sides rendered in harmony.

A row is one of TRL's preference forms (docs/dpo.md, "Data"):
- explicit prompt: `prompt`, `chosen`, `rejected`, each a list of messages (the Hugging Face chat form or
  harmony's JSON form, data/conversation.py); `prompt` may be a string (one user message) and a side a
  string (one final answer), TRL's standard form;
- implicit prompt: `chosen` and `rejected` only, each a whole conversation (a messages list, or an object
  with `messages` as harmony's `Conversation.to_json()` writes it) sharing everything before the reply.
The row's other columns (reasoning_effort, developer, tools, ...) are the conversation's fields on both sides.

Each side is rendered as SFT renders a conversation (data/harmony.py, train_on="last"): the system message
with its reasoning effort, earlier exchanges' analysis dropped as harmony does, and the loss mask on what
the assistant writes after the last user message (the last turn's analysis, preambles and tool calls
included, tool results never). The prompt of a side is every token before its first trained token; the
two sides must have the same prompt, neither may be empty and they may not be identical: each is one
ConversationError naming the side (callers add the file and row). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from gptoss_cli.data.conversation import MESSAGES_FIELD, parse_conversation
from gptoss_cli.data.harmony import ConversationError, HarmonyTokenizer, Message, Rendered, render_many
from gptoss_cli.data.token_format import read_token_header
from gptoss_cli.errors import ConfigError

SIDES = ("chosen", "rejected")
PROMPT = "prompt"
PREFERENCE_KIND = "preference"  # a token file's header "kind": documents 2i (chosen) and 2i+1 (rejected) are pair i
REFERENCE_SUFFIX = ".reference"  # PREFIX.reference: the reference's scores of the pairs PREFIX (preference/scores.py)


def check_preference_file(path: str | Path) -> dict:
    """The header of a preference token file (ConfigError naming the file and its kind otherwise)."""
    header = read_token_header(path)
    if header.get("kind") != PREFERENCE_KIND or header.get("num_documents", 1) % 2:
        raise ConfigError(f"{path}: a token file of kind {header.get('kind')!r} with {header.get('num_documents')} "
                          "documents, not preference pairs", hint="create it with `gptoss prepare-data "
                          "--format preference` (objective.kind=dpo trains on pairs)")
    return header


def reference_folder(prefix: str | Path) -> Path:
    """Where the reference's scores of the pairs `prefix` live: PREFIX.reference."""
    return Path(str(prefix) + REFERENCE_SUFFIX)


@dataclass
class RenderedPair:
    """Both sides of a pair, each a harmony document with its loss mask; `prompt_tokens` they share."""

    chosen: Rendered
    rejected: Rendered
    prompt_tokens: int


def _messages(value: Any, side: str) -> tuple[list, dict[str, Any]]:
    """(messages, the conversation fields beside them) of one column of a row."""
    if isinstance(value, str):
        role = "user" if side == PROMPT else "assistant"
        return [{"role": role, "content": value}], {}
    if isinstance(value, dict) and isinstance(value.get(MESSAGES_FIELD), list):  # Conversation.to_json()
        return list(value[MESSAGES_FIELD]), {k: v for k, v in value.items() if k != MESSAGES_FIELD}
    if isinstance(value, list):
        return list(value), {}
    raise ConversationError(f"{side!r} must be a list of messages, a conversation with \"messages\" or a string, "
                            f"not {type(value).__name__}")


def pair_conversations(row: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The conversations of the chosen and the rejected side of a row (module docstring: the forms)."""
    if not isinstance(row, dict) or any(s not in row for s in SIDES):
        have = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ConversationError(f"not a preference pair: expected \"chosen\" and \"rejected\" (and optionally "
                                f"\"prompt\"), found {have}")
    others = {k: v for k, v in row.items() if k not in SIDES + (PROMPT,)}
    prompt, prompt_fields = _messages(row[PROMPT], PROMPT) if row.get(PROMPT) is not None else ([], {})
    out = []
    for side in SIDES:
        messages, fields = _messages(row[side], side)
        if PROMPT in row and not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
            raise ConversationError(f"the {side} side is empty: no assistant message after the prompt")
        out.append({**others, **prompt_fields, **fields, MESSAGES_FIELD: prompt + messages})
    return out[0], out[1]


def parse_pair(row: Any) -> tuple[list[Message], list[Message]]:
    """The harmony messages of both sides of a row; ConversationError naming the side otherwise."""
    chosen, rejected = pair_conversations(row)
    parsed = []
    for side, conv in zip(SIDES, (chosen, rejected)):
        try:
            parsed.append(parse_conversation(conv))
        except ConversationError as exc:
            raise ConversationError(f"the {side} side: {exc}") from None
    return parsed[0], parsed[1]


def check_pair(chosen: Rendered, rejected: Rendered) -> RenderedPair:
    """The rendered pair once its sides share their prompt, both train something and differ."""
    firsts = []
    for side, doc in zip(SIDES, (chosen, rejected)):
        if not any(doc.mask):
            raise ConversationError(f"the {side} side is empty: nothing the assistant writes")
        firsts.append(doc.mask.index(1))
    a, b = chosen.ids[:firsts[0]], rejected.ids[:firsts[1]]
    if a != b:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise ConversationError(f"the prompt differs between the chosen and rejected sides (from token {at}: "
                                f"{len(a)} and {len(b)} prompt tokens); a pair is two replies to one prompt")
    if chosen.ids == rejected.ids:
        raise ConversationError("the chosen and rejected sides are identical; a pair needs two different replies")
    return RenderedPair(chosen, rejected, len(a))


def render_pairs(pairs: Sequence[tuple[list[Message], list[Message]]], tok: HarmonyTokenizer, *,
                 analysis: str = "keep") -> list[RenderedPair | ConversationError]:
    """Both sides of each pair rendered for training (one tokenizer batch for all), checked; a pair that cannot
    be rendered or fails a check gives its ConversationError in its place."""
    docs = render_many([side for pair in pairs for side in pair], tok, analysis=analysis, train_on="last")
    out: list[RenderedPair | ConversationError] = []
    for k in range(len(pairs)):
        c, r = docs[2 * k], docs[2 * k + 1]
        bad = next(((s, d) for s, d in zip(SIDES, (c, r)) if isinstance(d, ConversationError)), None)
        if bad is not None:
            out.append(ConversationError(f"the {bad[0]} side: {bad[1]}"))
            continue
        try:
            out.append(check_pair(c, r))
        except ConversationError as exc:
            out.append(exc)
    return out


__all__ = ["RenderedPair", "pair_conversations", "parse_pair", "check_pair", "render_pairs", "SIDES", "PROMPT", "PREFERENCE_KIND",
           "REFERENCE_SUFFIX", "check_preference_file", "reference_folder"]
