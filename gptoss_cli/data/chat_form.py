"""The Hugging Face chat form to harmony messages, as transformers' gpt-oss chat template takes it, rendered as harmony.

{"messages": [{"role", "content", "thinking"?, "tool_calls"?, "name"?, "tool_call_id"?}],
 "reasoning_effort"?, "developer"?, "conversation_start_date"?, "model_identity"?, "tools"?,
 "builtin_tools"?}. What each field becomes, and where this differs from the chat template (we
follow openai-harmony where they disagree), is in docs/sft-data.md. A null field counts as absent
(Parquet and Arrow rows fill the fields a message lacks with nulls). Torch-free.
"""

from __future__ import annotations

import json
from typing import Any

from gptoss_cli.data.fields import check_role, effort, optional_text, text
from gptoss_cli.data.harmony import SYSTEM_DEFAULTS, ConversationError, Message
from gptoss_cli.data.harmony_tools import BUILTIN_TOOLS, FUNCTIONS, ToolError, builtin_namespace, check_tool

JSON_CALL = "<|constrain|>json"  # harmony's content type of a function call's arguments
BUILTIN_CALL = "code"


def _content_text(raw: Any, where: str) -> str:
    """Hugging Face content: a string, or a list of {"type": "text", "text": ...} parts joined."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                     for p in raw):
        return "".join(p["text"] for p in raw)
    raise ConversationError(f"{where} content must be a string or a list of text parts")


def _function_tools(raw: Any) -> list[dict[str, Any]]:
    """`tools`: [{"type": "function", "function": {name, description, parameters}}] (or the bare functions)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConversationError("tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    out = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("function") is not None else t
        if isinstance(fn, dict):
            fn = {k: v for k, v in fn.items() if k in ("name", "description", "parameters") and v is not None}
        try:
            out.append(check_tool(fn, f"tools[{i}]"))
        except ToolError as exc:
            raise ConversationError(str(exc)) from None
    return out


def _builtin_tools(raw: Any) -> list[str]:
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(t in BUILTIN_TOOLS for t in raw):
        raise ConversationError(f"builtin_tools {raw!r} must be a list of {' and/or '.join(BUILTIN_TOOLS)}")
    return sorted(set(raw))


def _header(conv: dict, messages: list) -> tuple[list[Message], int, list[str]]:
    """The system and developer messages; how many leading messages they used; the enabled built-in tools."""
    builtins = _builtin_tools(conv.get("builtin_tools"))
    identity = conv.get("model_identity")
    system = {
        "type": "system_content", **SYSTEM_DEFAULTS,
        "model_identity": SYSTEM_DEFAULTS["model_identity"] if identity is None else text(identity, "model_identity"),
        "reasoning_effort": effort(conv.get("reasoning_effort") or "medium", "conversation"),
        "conversation_start_date": optional_text(conv, "conversation_start_date", "conversation"),
        "tools": [{"key": b, **builtin_namespace(b)} for b in builtins] or None,
    }
    developer = optional_text(conv, "developer", "conversation")
    used = 0
    for i, m in enumerate(messages):
        if m.get("role") not in ("system", "developer"):
            continue
        if developer is not None:
            raise ConversationError(f"message {i}: a second set of developer instructions (a 'developer' field or an "
                                    "earlier system/developer message already gave them)")
        developer = _content_text(m.get("content"), f"message {i}")  # the template: a system message -> developer
        used += 1
    functions = _function_tools(conv.get("tools"))
    out = [Message("system", (system,))]
    if developer is not None or functions:
        tools = [{"key": FUNCTIONS, "name": FUNCTIONS, "description": None, "tools": functions}] if functions else None
        out.append(Message("developer", ({"type": "developer_content", "instructions": developer, "tools": tools},)))
    return out, used, builtins


def _arguments(call: dict, where: str) -> str:
    args = call.get("arguments")
    if args is None:
        return "{}"
    if isinstance(args, str):
        return args  # already JSON text (the OpenAI API's form): as is
    try:
        return json.dumps(args, ensure_ascii=False)  # as the template's tojson writes a mapping
    except (TypeError, ValueError) as exc:
        raise ConversationError(f"{where} arguments are not JSON ({exc})") from None


def _recipient(name: str, builtins: list[str]) -> tuple[str, bool]:
    """(recipient, whether it is a built-in tool): `python` or `browser.search` when enabled, else functions.NAME."""
    if name.split(".")[0] in builtins:
        return name, True
    return (name if name.startswith(f"{FUNCTIONS}.") else f"{FUNCTIONS}.{name}"), False


class _Calls:
    """Tool calls awaiting their results, by id and in order (a result names its call, or takes the oldest)."""

    def __init__(self, builtins: list[str]):
        self.builtins, self.pending, self.by_id = builtins, [], {}

    def call_messages(self, m: dict, where: str) -> list[Message]:
        calls = m["tool_calls"]
        if not isinstance(calls, list) or not calls:
            raise ConversationError(f"{where} tool_calls must be a non-empty list")
        out = []
        for k, raw in enumerate(calls):
            at = f"{where} tool_calls[{k}]"
            fn = raw.get("function") if isinstance(raw, dict) and raw.get("function") is not None else raw
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ConversationError(f"{at} needs a function name")
            recipient, builtin = _recipient(fn["name"], self.builtins)
            default_type = BUILTIN_CALL if builtin else JSON_CALL
            content_type = optional_text(fn, "content_type", at) or default_type
            out.append(Message("assistant", (_arguments(fn, at),), channel="analysis" if builtin else "commentary",
                               recipient=recipient, content_type=content_type))
            self.pending.append(recipient)
            if isinstance(raw, dict) and raw.get("id") is not None:
                self.by_id[str(raw["id"])] = recipient
        return out

    def result_author(self, m: dict, where: str) -> str:
        if m.get("name") is not None:
            name = _recipient(text(m["name"], f"{where} name"), self.builtins)[0]
        elif m.get("tool_call_id") is not None and str(m["tool_call_id"]) in self.by_id:
            name = self.by_id[str(m["tool_call_id"])]
        elif self.pending:
            name = self.pending[0]
        else:
            raise ConversationError(f"{where}: a tool result with no tool call before it (give the tool's name)")
        if name in self.pending:
            self.pending.remove(name)
        return name


def _tool_result(m: dict, where: str, author: str, builtin: bool) -> Message:
    content = m.get("content")
    if isinstance(content, (str, list)) and _is_text(content):
        body = _content_text(content, where)
    else:  # a JSON value: as the template's tojson writes it
        body = json.dumps(content, ensure_ascii=False)
    return Message("tool", (body,), name=author, channel="analysis" if builtin else "commentary", recipient="assistant")


def _is_text(content: Any) -> bool:
    return isinstance(content, str) or all(isinstance(p, dict) and p.get("type") == "text" for p in content)


def _assistant(m: dict, where: str, calls: _Calls) -> list[Message]:
    thinking = m.get("thinking")
    content = m.get("content")
    thought = None if thinking is None else text(thinking, f"{where} thinking")
    said = None if content is None else _content_text(content, where)
    if m.get("tool_calls") is None:
        if said is None:
            raise ConversationError(f"{where}: an assistant message needs content (the answer) or tool_calls")
        out = [Message("assistant", (thought,), channel="analysis")] if thought is not None else []
        return out + [Message("assistant", (said,), channel="final")]
    out = []
    if thought is not None and said:  # both: the thinking is the analysis, the content a preamble to the user
        out += [Message("assistant", (thought,), channel="analysis"),
                Message("assistant", (said,), channel="commentary")]
    elif thought is not None or said:  # one of them: analysis, as the chat template renders it
        out.append(Message("assistant", (thought if thought is not None else said,), channel="analysis"))
    return out + calls.call_messages(m, where)


def parse_chat_form(conv: dict, messages: list) -> list[Message]:
    """The Hugging Face chat form as harmony messages (module docstring)."""
    out, _, builtins = _header(conv, messages)
    calls = _Calls(builtins)
    for i, m in enumerate(messages):
        where = f"message {i}"
        role = check_role(m.get("role"), where)
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(Message("user", (_content_text(m.get("content", ""), where),)))
        elif role == "tool":
            author = calls.result_author(m, where)
            out.append(_tool_result(m, where, author, author.split(".")[0] in builtins))
        else:
            out += _assistant(m, where, calls)
    return out


__all__ = ["parse_chat_form"]
