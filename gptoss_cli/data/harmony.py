"""Conversations in OpenAI's harmony format: render to token ids with a loss mask, render prompts, parse completions.

Pure functions over a `tokenizers.Tokenizer` (the checkpoint's tokenizer.json, whose harmony special
tokens give the formatting ids); no torch. Parsing the JSON forms is data/conversation.py's, tool
definitions data/harmony_tools.py's. A message renders as harmony does:

    <|start|>{role}[:{name}][ to={recipient}][<|channel|>{channel}][ {content_type}]<|message|>{content}<|end|>

(a tool message shows its name instead of its role; an assistant message with a recipient, a tool
call, ends with <|call|>; a content type starting with <|constrain|> renders that marker as its
special token). Every text piece is tokenized on its own, with special-token text in it tokenized
as plain text.

Training rendering (`render_for_training`): a turn is a run of consecutive assistant messages; the
last exchange is everything after the last user message (before the last turn). The document runs
through the last turn. --train-on last trains every turn of the last exchange (an agent trace: the
calls, and the answer after the last tool result), all trains every turn. The trained tokens (mask
1) of a turn are everything after the prompt's `<|start|>assistant` through its last message,
whose <|end|> becomes <|return|> when it is on the final channel (a tool call keeps its <|call|>);
tool results and users are never trained. Analysis (chain of thought): "keep" drops the analysis of
every exchange that a final-channel answer closed before the last exchange (the gpt-oss chat
template's rule), so the last exchange's analysis is rendered and trained; "drop" removes every
analysis message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from gptoss_cli.data.harmony_tools import has_function_tools, tools_section

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
    text treated as ordinary text (as harmony's encode_ordinary does). Fixed texts (headers, system and
    developer messages, which repeat from conversation to conversation) are cached."""

    CACHE_ENTRIES = 4096

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
        self._cache: dict[str, list[int]] = {}

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, in one batch call for those not cached (`Fixed` texts are cached)."""
        out: list[Any] = [self._cache.get(t) if isinstance(t, Fixed) else None for t in texts]
        todo = sorted({t for t, o in zip(texts, out) if o is None})
        if todo:
            found = dict(zip(todo, (e.ids for e in self.tokenizer.encode_batch(todo, add_special_tokens=False))))
            if len(self._cache) > self.CACHE_ENTRIES:
                self._cache.clear()
            for i, t in enumerate(texts):
                if out[i] is None:
                    out[i] = found[t]
                    if isinstance(t, Fixed):
                        self._cache[str(t)] = found[t]
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


class Fixed(str):
    """A text piece that recurs across conversations (a header, a system or developer message): cached."""


# ---------------------------------------------------------------------------------------- rendering


def _system_text(c: dict[str, Any], function_tools: bool) -> str:
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
    if c.get("tools"):
        sections.append(tools_section(c["tools"]))
    cc = c["channel_config"]
    if cc is not None and cc["valid_channels"]:
        header = f"# Valid channels: {', '.join(cc['valid_channels'])}."
        if cc["channel_required"]:
            header += " Channel must be included for every message."
        if function_tools:
            header += "\nCalls to these tools must go to the commentary channel: 'functions'."
        sections.append(header)
    return "\n\n".join(sections)


def _developer_text(c: dict[str, Any]) -> str:
    sections = ["# Instructions", c["instructions"]] if c["instructions"] is not None else []
    if c.get("tools"):
        sections.append(tools_section(c["tools"]))
    return "\n\n".join(sections)


def conversation_has_function_tools(messages: Sequence[Message]) -> bool:
    """Whether a developer message declares function tools (harmony then adds a line to the system message)."""
    return any(isinstance(p, dict) and p["type"] == "developer_content" and has_function_tools(p.get("tools"))
               for m in messages for p in m.content)


def _message_pieces(m: Message, end: str | None = None, function_tools: bool = False) -> list[Any]:
    """The message as text pieces (str) and formatting tokens (1-tuples of a SPECIAL_TOKENS key), in order."""
    pieces: list[Any] = [("start",), Fixed(m.name if m.role == "tool" else m.role)]
    if m.role != "tool" and m.name is not None:
        pieces.append(Fixed(f":{m.name}"))
    if m.recipient is not None and m.recipient != "all":
        pieces.append(Fixed(f" to={m.recipient}"))
    if m.channel is not None:
        pieces += [("channel",), Fixed(m.channel)]
    if m.content_type is not None:
        marker = SPECIAL_TOKENS["constrain"]
        if m.content_type.startswith(marker):
            pieces += [Fixed(" "), ("constrain",)]
            if m.content_type[len(marker):]:
                pieces.append(Fixed(m.content_type[len(marker):]))
        else:
            pieces.append(Fixed(f" {m.content_type}"))
    pieces.append(("message",))
    for part in m.content:
        if isinstance(part, str):
            pieces.append(part)
        elif part["type"] == "system_content":
            pieces.append(Fixed(_system_text(part, function_tools)))
        else:
            pieces.append(Fixed(_developer_text(part)))
    pieces.append((end or ("call" if m.is_tool_call else "end"),))
    return pieces


def _encode_groups(groups: list[list[Any]], tok: HarmonyTokenizer) -> list[list[list[int]]]:
    """Token ids of each piece of each group (one batch call for every text): [group][piece] -> ids."""
    texts = [p for g in groups for p in g if isinstance(p, str) and p]
    encoded = iter(tok.encode_texts(texts))
    return [[[tok.ids[p[0]]] if isinstance(p, tuple) else (next(encoded) if p else []) for p in g] for g in groups]


def _encode(pieces: list[Any], tok: HarmonyTokenizer) -> list[int]:
    return [t for piece in _encode_groups([pieces], tok)[0] for t in piece]


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
    """Which messages stay: "drop" removes every analysis message (chain of thought; a call to a built-in tool on
    the analysis channel stays); "keep" removes those of exchanges that a final-channel assistant message closed
    before message index `before`."""
    last_final = max((i for i, m in enumerate(messages[:before]) if m.role == "assistant" and m.channel == "final"),
                     default=-1)
    return [not (m.channel == "analysis" and m.role == "assistant" and not m.is_tool_call
                 and (analysis == "drop" or i < last_final)) for i, m in enumerate(messages)]


@dataclass
class _Plan:
    """What render_for_training renders: message indices, each one's end token, and which turns are trained."""

    keep: list[bool]
    stop: int
    starts: set[int]
    ends: set[int]
    num_turns: int
    trained_turns: int


def _plan(messages: Sequence[Message], analysis: str, train_on: str) -> _Plan:
    if analysis not in ANALYSIS_MODES:
        raise ValueError(f"analysis {analysis!r} is not one of {ANALYSIS_MODES}")
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on {train_on!r} is not one of {TRAIN_ON}")
    turns = _turns(messages)
    if not turns:
        raise ConversationError("the conversation has no assistant turn to train on")
    # the last exchange: everything after the last user message before the last assistant turn
    exchange = 1 + max((i for i in range(turns[-1][0]) if messages[i].role == "user"), default=-1)
    keep = _drop_analysis(messages, analysis, exchange)
    trained = turns if train_on == "all" else [t for t in turns if t[0] >= exchange]
    starts, ends = set(), set()
    for a, b in trained:
        kept = [i for i in range(a, b) if keep[i]]
        if not kept:
            raise ConversationError(f"the assistant turn at message {a} has only analysis messages, which "
                                    "--analysis drop removes; nothing is left to train")
        last = messages[kept[-1]]
        if not (last.channel == "final" or last.is_tool_call):
            raise ConversationError(f"the assistant turn at message {a} ends with a {last.channel or 'channel-less'} "
                                    "message; a trained turn ends with a final-channel answer or a tool call")
        starts.add(kept[0])
        ends.add(kept[-1])
    return _Plan(keep, turns[-1][1], starts, ends, len(turns), len(trained))


def render_many(conversations: Sequence[Sequence[Message]], tok: HarmonyTokenizer, *, analysis: str = "keep",
                train_on: str = "last") -> list[Rendered | ConversationError]:
    """render_for_training of each conversation, tokenized in one batch; a conversation that cannot be
    rendered gives its ConversationError in its place."""
    plans: list[Any] = []
    groups: list[list[Any]] = []
    for messages in conversations:
        try:
            plan = _plan(messages, analysis, train_on)
        except ConversationError as exc:
            plans.append(exc)
            continue
        function_tools = conversation_has_function_tools(messages)
        plans.append((plan, messages))
        for i in range(plan.stop):
            if plan.keep[i]:
                m = messages[i]
                end = "return" if i in plan.ends and not m.is_tool_call else None
                groups.append(_message_pieces(m, end, function_tools))
    encoded = iter(_encode_groups(groups, tok))
    out: list[Rendered | ConversationError] = []
    for item in plans:
        if isinstance(item, ConversationError):
            out.append(item)
            continue
        plan, messages = item
        ids: list[int] = []
        mask: list[int] = []
        rendered: list[Message] = []
        training = False
        for i in range(plan.stop):
            if not plan.keep[i]:
                continue
            pieces = next(encoded)
            n = sum(map(len, pieces))
            if i in plan.starts:
                training = True
                # the prompt ends with <|start|>assistant (the first two pieces): inputs; the rest the model writes
                prompt = len(pieces[0]) + len(pieces[1])
                mask += [0] * prompt + [1] * (n - prompt)
            else:
                mask += [1 if training else 0] * n
            ids += [t for p in pieces for t in p]
            rendered.append(messages[i])
            if i in plan.ends:
                training = False
        out.append(Rendered(ids, mask, num_turns=plan.num_turns, trained_turns=plan.trained_turns, messages=rendered))
    return out


def render_for_training(messages: Sequence[Message], tok: HarmonyTokenizer, *, analysis: str = "keep",
                        train_on: str = "last") -> Rendered:
    """Token ids and loss mask of a conversation for training (module docstring: what is trained)."""
    result = render_many([messages], tok, analysis=analysis, train_on=train_on)[0]
    if isinstance(result, ConversationError):
        raise result
    return result


def render_prompt(messages: Sequence[Message], tok: HarmonyTokenizer) -> list[int]:
    """Token ids of a prompt for generation: the conversation (earlier exchanges' analysis dropped) then
    `<|start|>assistant`, as harmony's render_conversation_for_completion does."""
    keep = _drop_analysis(messages, "keep", len(messages))
    function_tools = conversation_has_function_tools(messages)
    pieces: list[Any] = []
    for m, k in zip(messages, keep):
        if k:
            pieces += _message_pieces(m, function_tools=function_tools)
    return _encode(pieces + [("start",), Fixed("assistant")], tok)


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


__all__ = ["ConversationError", "Message", "Rendered", "HarmonyTokenizer", "Fixed", "render_for_training", "render_many",
           "render_prompt", "parse_completion", "conversation_has_function_tools", "ROLES", "ANALYSIS_MODES",
           "TRAIN_ON", "SPECIAL_TOKENS", "SYSTEM_DEFAULTS", "DEFAULT_CHANNELS", "REASONING_EFFORTS"]
