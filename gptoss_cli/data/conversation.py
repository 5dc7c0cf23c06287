"""Conversations from JSON to harmony messages: harmony's own form, the Hugging Face chat form (data/chat_form.py),
a dataset row through a --field mapping, and a conversation read as a prompt (generation, RL).

harmony's form is what `openai_harmony.Conversation.to_json()` writes: typed system/developer
parts (with their `tools` namespaces), channels, recipients, content types, tool messages named by
their tool. Everything is checked here, so rendering (data/harmony.py) never sees a bad field.
Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from gptoss_cli.data.harmony import (
    DEFAULT_CHANNELS, SYSTEM_DEFAULTS, ConversationError, Message,
)
from gptoss_cli.data.chat_form import parse_chat_form
from gptoss_cli.data.fields import check_role, effort, optional_text, text
from gptoss_cli.data.harmony_tools import ToolError, check_namespaces
from gptoss_cli.json_input import parse_json

MESSAGES_FIELD = "messages"





def namespaces(raw: Any, where: str) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    try:
        return check_namespaces(raw, where)
    except ToolError as exc:
        raise ConversationError(str(exc)) from None


def _system_content(raw: dict, where: str) -> dict[str, Any]:
    known = set(SYSTEM_DEFAULTS) | {"tools", "type"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConversationError(f"{where}: unknown system_content field(s) {unknown}")
    out = {k: (raw[k] if k in raw else v) for k, v in SYSTEM_DEFAULTS.items()}
    for key in ("model_identity", "conversation_start_date", "knowledge_cutoff"):
        if out[key] is not None:
            text(out[key], f"{where} {key!r}")
    if out["reasoning_effort"] is not None:
        out["reasoning_effort"] = effort(out["reasoning_effort"], where)
    cc = out["channel_config"]
    if cc is not None:
        if (not isinstance(cc, dict) or not isinstance(cc.get("valid_channels"), list)
                or not all(isinstance(c, str) for c in cc["valid_channels"])
                or not isinstance(cc.get("channel_required"), bool)):
            raise ConversationError(f"{where}: channel_config must be {{\"valid_channels\": [names], "
                                    f"\"channel_required\": true|false}}, not {cc!r}")
    return {"type": "system_content", **out, "tools": namespaces(raw.get("tools"), where)}


def _developer_content(raw: dict, where: str) -> dict[str, Any]:
    unknown = sorted(set(raw) - {"instructions", "tools", "type"})
    if unknown:
        raise ConversationError(f"{where}: unknown developer_content field(s) {unknown}")
    return {"type": "developer_content", "instructions": optional_text(raw, "instructions", where),
            "tools": namespaces(raw.get("tools"), where)}


def _harmony_parts(raw: Any, role: str, where: str) -> tuple[Any, ...]:
    if isinstance(raw, str):
        return (raw,)
    if not isinstance(raw, list):
        raise ConversationError(f"{where} content must be a string or a list of parts, not {type(raw).__name__}")
    parts: list[Any] = []
    for k, part in enumerate(raw):
        at = f"{where} part {k}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append(text(part.get("text"), f"{at} text"))
        elif kind == "system_content" and role == "system":
            parts.append(_system_content(part, at))
        elif kind == "developer_content" and role == "developer":
            parts.append(_developer_content(part, at))
        else:
            raise ConversationError(f"{at}: a {role} message cannot hold a part of type {kind!r} "
                                    "(text; system_content in system, developer_content in developer messages)")
    return tuple(parts)


def _is_harmony_form(messages: list) -> bool:
    """harmony's Conversation.to_json() form: typed system/developer parts, channels, recipients or tool names."""
    for m in messages:
        if any(m.get(k) is not None for k in ("channel", "recipient", "content_type")):
            return True
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in ("system_content",
                                                                                       "developer_content")
                                             for p in content):
            return True
    return False


def _parse_harmony(messages: list) -> list[Message]:
    out = []
    for i, m in enumerate(messages):
        where = f"message {i}"
        role = check_role(m.get("role"), where)
        out.append(Message(
            role=role, content=_harmony_parts(m.get("content"), role, where),
            name=optional_text(m, "name", where), channel=optional_text(m, "channel", where),
            recipient=optional_text(m, "recipient", where), content_type=optional_text(m, "content_type", where),
        ))
    return out


def _valid_channels(messages: Sequence[Message]) -> tuple[tuple[str, ...], bool]:
    for m in messages:
        for part in m.content:
            if isinstance(part, dict) and part.get("type") == "system_content" and part["channel_config"]:
                cc = part["channel_config"]
                return tuple(cc["valid_channels"]), cc["channel_required"]
    return DEFAULT_CHANNELS, False


def _check_channels(messages: Sequence[Message]) -> None:
    valid, required = _valid_channels(messages)
    for i, m in enumerate(messages):
        if m.channel is not None and m.channel not in valid:
            raise ConversationError(f"message {i}: unknown channel {m.channel!r} (one of {', '.join(valid)})")
        if m.role == "assistant" and m.channel is None and required:
            raise ConversationError(f"message {i}: an assistant message needs a channel (one of {', '.join(valid)})")
        if m.role == "tool" and not m.name:
            raise ConversationError(f"message {i}: a tool message needs the tool's name")


def parse_conversation(conv: Any) -> list[Message]:
    """The messages of one conversation: harmony's `Conversation.to_json()` form or the Hugging Face chat form
    (docs/sft-data.md; data/chat_form.py). ConversationError for anything else."""
    if not isinstance(conv, dict) or not isinstance(conv.get(MESSAGES_FIELD), list):
        raise ConversationError("not a conversation: expected an object with a \"messages\" list")
    messages = conv[MESSAGES_FIELD]
    if not messages:
        raise ConversationError("the conversation has no messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConversationError(f"message {i} is not an object")
    if _is_harmony_form(messages):
        parsed = _parse_harmony(messages)
    else:
        parsed = parse_chat_form(conv, messages)
    _check_channels(parsed)
    return parsed


def conversation_from_row(row: Any, field_name: str = MESSAGES_FIELD) -> dict[str, Any]:
    """The conversation a dataset row (a JSONL line, a Parquet or Arrow row) holds. Its `field_name` column holds
    the messages, or a string of JSON: a whole conversation (what a JSONL line holds) or its messages list. The
    row's other columns are the conversation's other fields (reasoning_effort, tools, ...; a `tools` column may be
    a string of JSON too)."""
    if not isinstance(row, dict):
        raise ConversationError("not a conversation: expected an object with a \"messages\" list")
    if field_name not in row:
        raise ConversationError(f"not a conversation: no {field_name!r} field (the messages); --field names the one "
                                "that holds them")
    value = row[field_name]
    if isinstance(value, str):
        try:
            value = parse_json(value)
        except (ValueError, RecursionError) as exc:
            raise ConversationError(f"field {field_name!r} is a string but not JSON ({exc})") from None
    others = {k: v for k, v in row.items() if k != field_name}
    if isinstance(value, dict):  # a whole conversation
        return value if not others else {**others, **value}
    conv = {**others, MESSAGES_FIELD: value}
    if isinstance(conv.get("tools"), str):
        try:
            conv["tools"] = json.loads(conv["tools"])
        except ValueError as exc:
            raise ConversationError(f"field 'tools' is a string but not JSON ({exc})") from None
    return conv


@dataclass
class PromptConversation:
    """A conversation read as a prompt: its messages (ending before the assistant's reply) and the record's
    other fields (for a reward function: reference answers, test cases, ...)."""

    messages: list[Message]
    extra: dict[str, Any] = field(default_factory=dict)


def parse_prompt(record: Any, field_name: str = MESSAGES_FIELD) -> PromptConversation:
    """A record (a JSONL line or dataset row) as a prompt: the conversation must end before an assistant reply
    (its last message is not the assistant's, unless it is a turn still under way: analysis or a preamble)."""
    conv = conversation_from_row(record, field_name)
    messages = parse_conversation(conv)
    last = messages[-1]
    if last.role == "assistant" and (last.channel == "final" or last.is_tool_call):
        raise ConversationError("the conversation ends with an assistant reply; a prompt ends before it")
    known = {MESSAGES_FIELD, "reasoning_effort", "developer", "conversation_start_date", "model_identity", "tools",
             "builtin_tools"}
    return PromptConversation(messages, {k: v for k, v in conv.items() if k not in known})


__all__ = ["parse_conversation", "conversation_from_row", "parse_prompt", "PromptConversation", "MESSAGES_FIELD"]
