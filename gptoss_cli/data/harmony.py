"""Conversations in OpenAI's harmony format: parse, render to token ids with a loss mask, render prompts, parse completions.

Pure functions over a `tokenizers.Tokenizer` (the checkpoint's tokenizer.json, whose harmony special
tokens give the formatting ids); no torch. A message renders as harmony does:

    <|start|>{role}[:{name}][ to={recipient}][<|channel|>{channel}][ {content_type}]<|message|>{content}<|end|>

(a tool message shows its name instead of its role; an assistant message with a recipient ends
with <|call|>; a content type starting with <|constrain|> renders that marker as its special token).
Every text piece is tokenized on its own, with special-token text in it tokenized as plain text.

Training rendering (`render_for_training`): a turn is a run of consecutive assistant messages.
The document runs through the last trained turn (--train-on last: the last turn; all: every
turn). The trained tokens (mask 1) of a turn are everything after the prompt's
`<|start|>assistant` through its last message, whose <|end|> becomes <|return|> when it is on the
final channel (a tool call keeps its <|call|>). Analysis (chain of thought): "keep" drops the
analysis of every exchange that a final-channel answer closed before the last trained turn (the
gpt-oss chat template's rule), so the last turn's analysis is rendered and trained; "drop" removes
every analysis message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

ROLES = ("system", "developer", "user", "assistant", "tool")
DEFAULT_CHANNELS = ("analysis", "commentary", "final")
REASONING_EFFORTS = ("low", "medium", "high")
ANALYSIS_MODES = ("keep", "drop")
TRAIN_ON = ("last", "all")
# harmony's formatting tokens, by the name this module uses
SPECIAL_TOKENS = {
    "start": "<|start|>", "channel": "<|channel|>", "message": "<|message|>", "end": "<|end|>",
    "return": "<|return|>", "call": "<|call|>", "constrain": "<|constrain|>",
}
# what `SystemContent()` of openai-harmony holds when a field is absent (an explicit null omits it)
SYSTEM_DEFAULTS: dict[str, Any] = {
    "model_identity": "You are ChatGPT, a large language model trained by OpenAI.",
    "reasoning_effort": "medium",
    "conversation_start_date": None,
    "knowledge_cutoff": "2024-06",
    "channel_config": {"valid_channels": list(DEFAULT_CHANNELS), "channel_required": True},
}


class ConversationError(ValueError):
    """A conversation that cannot be rendered; the message says which message or field (callers add file:line)."""


@dataclass(frozen=True)
class Message:
    """One harmony message. `content` holds text strings and, in system/developer messages, dicts of
    `system_content` / `developer_content` fields (already checked)."""

    role: str
    content: tuple[Any, ...]
    name: str | None = None
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    @property
    def is_tool_call(self) -> bool:
        return self.role == "assistant" and self.recipient is not None


@dataclass
class Rendered:
    """Token ids of one document and its loss mask (1 = a trained target), same length."""

    ids: list[int]
    mask: list[int]
    num_turns: int = 0
    trained_turns: int = 0
    messages: list[Message] = field(default_factory=list, repr=False)


# ----------------------------------------------------------------------------------------- tokenizer


class HarmonyTokenizer:
    """A tokenizers.Tokenizer with harmony's special token ids; text is encoded with special-token
    text treated as ordinary text (as harmony's encode_ordinary does)."""

    def __init__(self, tokenizer: Any, source: str = "tokenizer.json"):
        ids = {}
        for key, token in SPECIAL_TOKENS.items():
            tid = tokenizer.token_to_id(token)
            if tid is None:
                raise ConversationError(f"{source}: no {token} token; harmony needs the GPT-OSS special tokens "
                                        f"({', '.join(SPECIAL_TOKENS.values())})")
            ids[key] = tid
        self.ids = ids
        self.tokenizer = tokenizer
        self.tokenizer.encode_special_tokens = True  # "<|end|>" inside a message is text, never a token
        self.source = source

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


# ------------------------------------------------------------------------------------------ parsing


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConversationError(f"{where} must be a string, not {type(value).__name__}")
    return value


def _optional_text(raw: dict, key: str, where: str) -> str | None:
    value = raw.get(key)
    return None if value is None else _text(value, f"{where} {key!r}")


def _effort(value: Any, where: str) -> str:
    if not isinstance(value, str) or value.lower() not in REASONING_EFFORTS:
        raise ConversationError(f"{where} reasoning_effort {value!r} is not one of {', '.join(REASONING_EFFORTS)}")
    return value.lower()


def _no_tools(raw: dict, where: str) -> None:
    if raw.get("tools"):
        raise ConversationError(f"{where} declares tools; rendering tool definitions is not supported yet "
                                "(tool calls and tool messages are)")


def _system_content(raw: dict, where: str) -> dict[str, Any]:
    known = set(SYSTEM_DEFAULTS) | {"tools", "type"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConversationError(f"{where}: unknown system_content field(s) {unknown}")
    _no_tools(raw, where)
    out = {k: (raw[k] if k in raw else v) for k, v in SYSTEM_DEFAULTS.items()}
    for key in ("model_identity", "conversation_start_date", "knowledge_cutoff"):
        if out[key] is not None:
            _text(out[key], f"{where} {key!r}")
    if out["reasoning_effort"] is not None:
        out["reasoning_effort"] = _effort(out["reasoning_effort"], where)
    cc = out["channel_config"]
    if cc is not None:
        if (not isinstance(cc, dict) or not isinstance(cc.get("valid_channels"), list)
                or not all(isinstance(c, str) for c in cc["valid_channels"])
                or not isinstance(cc.get("channel_required"), bool)):
            raise ConversationError(f"{where}: channel_config must be {{\"valid_channels\": [names], "
                                    f"\"channel_required\": true|false}}, not {cc!r}")
    return {"type": "system_content", **out}


def _developer_content(raw: dict, where: str) -> dict[str, Any]:
    unknown = sorted(set(raw) - {"instructions", "tools", "type"})
    if unknown:
        raise ConversationError(f"{where}: unknown developer_content field(s) {unknown}")
    _no_tools(raw, where)
    return {"type": "developer_content", "instructions": _optional_text(raw, "instructions", where)}


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
            parts.append(_text(part.get("text"), f"{at} text"))
        elif kind == "system_content" and role == "system":
            parts.append(_system_content(part, at))
        elif kind == "developer_content" and role == "developer":
            parts.append(_developer_content(part, at))
        else:
            raise ConversationError(f"{at}: a {role} message cannot hold a part of type {kind!r} "
                                    "(text; system_content in system, developer_content in developer messages)")
    return tuple(parts)


def _check_role(role: Any, where: str) -> str:
    if role not in ROLES:
        raise ConversationError(f"{where}: unknown role {role!r} (one of {', '.join(ROLES)})")
    return role


def _is_harmony_form(messages: list) -> bool:
    """harmony's Conversation.to_json() form: typed system/developer parts, channels, recipients or tool names."""
    for m in messages:
        if not isinstance(m, dict):
            continue
        if any(k in m for k in ("channel", "recipient", "content_type")):
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
        role = _check_role(m.get("role"), where)
        out.append(Message(
            role=role, content=_harmony_parts(m.get("content"), role, where),
            name=_optional_text(m, "name", where), channel=_optional_text(m, "channel", where),
            recipient=_optional_text(m, "recipient", where), content_type=_optional_text(m, "content_type", where),
        ))
    return out


def _hf_text(raw: Any, where: str) -> str:
    """Hugging Face content: a string, or a list of {"type": "text", "text": ...} parts joined."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                     for p in raw):
        return "".join(p["text"] for p in raw)
    raise ConversationError(f"{where} content must be a string or a list of text parts")


def _parse_hf(conv: dict, messages: list) -> list[Message]:
    """The Hugging Face chat form, rendered as the gpt-oss chat template renders it, but with the date
    only when the conversation gives one (`conversation_start_date`)."""
    system = {
        "type": "system_content", **SYSTEM_DEFAULTS,
        "reasoning_effort": _effort(conv.get("reasoning_effort", "medium"), "reasoning_effort"),
        "conversation_start_date": _optional_text(conv, "conversation_start_date", "conversation"),
    }
    developer = _optional_text(conv, "developer", "conversation")
    out = [Message("system", (system,))]
    body: list[Message] = []
    for i, m in enumerate(messages):
        where = f"message {i}"
        role = _check_role(m.get("role"), where)
        if role == "tool" or "tool_calls" in m:
            raise ConversationError(f"{where}: tool calls and tool results in the Hugging Face form are not "
                                    "supported yet; write the conversation in harmony's JSON form")
        text = _hf_text(m.get("content", ""), where)
        if role in ("system", "developer"):
            if developer is not None:
                raise ConversationError(f"{where}: a second set of developer instructions (a 'developer' field or an "
                                        "earlier system/developer message already gave them)")
            developer = text  # the gpt-oss chat template turns a system message into developer instructions
        elif role == "user":
            body.append(Message("user", (text,)))
        else:
            thinking = m.get("thinking")
            if thinking is not None:
                body.append(Message("assistant", (_text(thinking, f"{where} thinking"),), channel="analysis"))
            body.append(Message("assistant", (text,), channel="final"))
    if developer is not None:
        out.append(Message("developer", ({"type": "developer_content", "instructions": developer},)))
    return out + body


def parse_conversation(conv: Any) -> list[Message]:
    """The messages of one JSONL conversation: harmony's `Conversation.to_json()` form or the Hugging Face
    chat form ({"messages": [{"role", "content", "thinking"?}], "reasoning_effort"?, "developer"?,
    "conversation_start_date"?}). ConversationError for anything else."""
    if not isinstance(conv, dict) or not isinstance(conv.get("messages"), list):
        raise ConversationError("not a conversation: expected an object with a \"messages\" list")
    messages = conv["messages"]
    if not messages:
        raise ConversationError("the conversation has no messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConversationError(f"message {i} is not an object")
    parsed = _parse_harmony(messages) if _is_harmony_form(messages) else _parse_hf(conv, messages)
    _check_channels(parsed)
    return parsed


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


# ---------------------------------------------------------------------------------------- rendering


def _system_text(c: dict[str, Any]) -> str:
    sections = []
    top = [c["model_identity"]] if c["model_identity"] is not None else []
    if c["knowledge_cutoff"] is not None:
        top.append(f"Knowledge cutoff: {c['knowledge_cutoff']}")
    if c["conversation_start_date"] is not None:
        top.append(f"Current date: {c['conversation_start_date']}")
    if top:
        sections.append("\n".join(top))
    if c["reasoning_effort"] is not None:
        sections.append(f"Reasoning: {c['reasoning_effort']}")
    cc = c["channel_config"]
    if cc is not None and cc["valid_channels"]:
        header = f"# Valid channels: {', '.join(cc['valid_channels'])}."
        if cc["channel_required"]:
            header += " Channel must be included for every message."
        sections.append(header)
    return "\n\n".join(sections)


def _developer_text(c: dict[str, Any]) -> str:
    return "\n\n".join(["# Instructions", c["instructions"]]) if c["instructions"] is not None else ""


def _message_pieces(m: Message, end: str | None = None) -> list[Any]:
    """The message as text pieces (str) and formatting tokens (1-tuples of a SPECIAL_TOKENS key), in order."""
    pieces: list[Any] = [("start",), m.name if m.role == "tool" else m.role]
    if m.role != "tool" and m.name is not None:
        pieces.append(f":{m.name}")
    if m.recipient is not None and m.recipient != "all":
        pieces.append(f" to={m.recipient}")
    if m.channel is not None:
        pieces += [("channel",), m.channel]
    if m.content_type is not None:
        marker = SPECIAL_TOKENS["constrain"]
        if m.content_type.startswith(marker):
            pieces += [" ", ("constrain",)]
            if m.content_type[len(marker):]:
                pieces.append(m.content_type[len(marker):])
        else:
            pieces.append(f" {m.content_type}")
    pieces.append(("message",))
    for part in m.content:
        if isinstance(part, str):
            pieces.append(part)
        elif part["type"] == "system_content":
            pieces.append(_system_text(part))
        else:
            pieces.append(_developer_text(part))
    pieces.append((end or ("call" if m.is_tool_call else "end"),))
    return pieces


def _encode(pieces: list[Any], tok: HarmonyTokenizer) -> list[int]:
    texts = [p for p in pieces if isinstance(p, str) and p]
    encoded = iter(tok.encode_texts(texts))
    ids: list[int] = []
    for p in pieces:
        if isinstance(p, tuple):
            ids.append(tok.ids[p[0]])
        elif p:
            ids.extend(next(encoded))
    return ids


def _turns(messages: Sequence[Message]) -> list[tuple[int, int]]:
    """[start, stop) message ranges of the assistant turns (runs of consecutive assistant messages)."""
    turns, i = [], 0
    while i < len(messages):
        if messages[i].role == "assistant":
            j = i
            while j < len(messages) and messages[j].role == "assistant":
                j += 1
            turns.append((i, j))
            i = j
        else:
            i += 1
    return turns


def _drop_analysis(messages: Sequence[Message], analysis: str, before: int) -> list[bool]:
    """Which messages stay: "drop" removes every analysis message; "keep" removes those of exchanges that a
    final-channel assistant message closed before message index `before`."""
    last_final = max((i for i, m in enumerate(messages[:before]) if m.role == "assistant" and m.channel == "final"),
                     default=-1)
    return [not (m.channel == "analysis" and m.role == "assistant" and (analysis == "drop" or i < last_final))
            for i, m in enumerate(messages)]


def render_for_training(messages: Sequence[Message], tok: HarmonyTokenizer, *, analysis: str = "keep",
                        train_on: str = "last") -> Rendered:
    """Token ids and loss mask of a conversation for training (module docstring: what is trained)."""
    if analysis not in ANALYSIS_MODES:
        raise ValueError(f"analysis {analysis!r} is not one of {ANALYSIS_MODES}")
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on {train_on!r} is not one of {TRAIN_ON}")
    turns = _turns(messages)
    if not turns:
        raise ConversationError("the conversation has no assistant turn to train on")
    last_start, stop = turns[-1]
    keep = _drop_analysis(messages, analysis, last_start)
    trained = turns if train_on == "all" else turns[-1:]
    ends = set()  # index of the last kept message of each trained turn
    for a, b in trained:
        kept = [i for i in range(a, b) if keep[i]]
        if not kept:
            raise ConversationError(f"the assistant turn at message {a} has only analysis messages, which "
                                    "--analysis drop removes; nothing is left to train")
        last = messages[kept[-1]]
        if not (last.channel == "final" or last.is_tool_call):
            raise ConversationError(f"the assistant turn at message {a} ends with a {last.channel or 'channel-less'} "
                                    "message; a trained turn ends with a final-channel answer or a tool call")
        ends.add(kept[-1])
    starts = {next(i for i in range(a, b) if keep[i]) for a, b in trained}
    ids: list[int] = []
    mask: list[int] = []
    rendered: list[Message] = []
    training = False
    for i in range(stop):
        if not keep[i]:
            continue
        m = messages[i]
        end = "return" if i in ends and not m.is_tool_call else None
        piece_ids = _encode(_message_pieces(m, end), tok)
        if i in starts:
            training = True
            # the prompt ends with <|start|>assistant: those tokens are inputs; the rest is what the model writes
            prompt = 1 + len(_encode(["assistant"], tok))
            mask += [0] * prompt + [1] * (len(piece_ids) - prompt)
        else:
            mask += [1 if training else 0] * len(piece_ids)
        ids += piece_ids
        rendered.append(m)
        if i in ends:
            training = False
    return Rendered(ids, mask, num_turns=len(turns), trained_turns=len(trained), messages=rendered)


def render_prompt(messages: Sequence[Message], tok: HarmonyTokenizer) -> list[int]:
    """Token ids of a prompt for generation: the conversation (earlier exchanges' analysis dropped) then
    `<|start|>assistant`, as harmony's render_conversation_for_completion does."""
    keep = _drop_analysis(messages, "keep", len(messages))
    pieces: list[Any] = []
    for m, k in zip(messages, keep):
        if k:
            pieces += _message_pieces(m)
    return _encode(pieces + [("start",), "assistant"], tok)


def parse_completion(ids: Iterable[int], tok: HarmonyTokenizer) -> list[Message]:
    """The assistant messages of generated tokens (what follows a render_prompt prompt), up to <|return|> or
    <|call|>: channel, recipient, content type and text of each; a message cut off before its end token is
    returned as it stands. The header may name the recipient before or after the channel, as models do."""
    special = {v: k for k, v in tok.ids.items()}
    messages: list[Message] = []
    header: list[tuple[str, list[int]]] = [("role", [])]
    body: list[int] | None = None

    def finish() -> None:
        fields = {name: tok.decode(part) for name, part in header}
        role, recipient, content_type = fields.get("role", "").strip(), None, None
        channel = fields.get("channel")
        if " to=" in f" {role}":
            role, recipient = f" {role}".split(" to=", 1)
        if channel is not None:
            words = channel.split()
            channel, rest = (words[0] if words else ""), words[1:]
            for w in rest:
                if w.startswith("to="):
                    recipient = w[3:]
                else:
                    content_type = w
        if "constrain" in fields:
            content_type = SPECIAL_TOKENS["constrain"] + fields["constrain"].strip()
        messages.append(Message(role.strip() or "assistant", (tok.decode(body or []),), channel=channel,
                                recipient=recipient.strip() if recipient else None, content_type=content_type))

    for t in ids:
        name = special.get(t)
        if body is None:
            if name == "start":
                header = [("role", [])]
            elif name == "message":
                body = []
            elif name in ("channel", "constrain"):
                header.append((name, []))
            else:
                header[-1][1].append(t)
        elif name in ("end", "return", "call"):
            finish()
            header, body = [("role", [])], None
            if name != "end":
                return messages
        else:
            body.append(t)
    if body is not None:
        finish()
    return messages


__all__ = ["ConversationError", "Message", "Rendered", "HarmonyTokenizer", "parse_conversation", "render_for_training",
           "render_prompt", "parse_completion", "ROLES", "ANALYSIS_MODES", "TRAIN_ON", "SPECIAL_TOKENS"]
