"""Prompts and replies for `gptoss generate`: harmony (a conversation rendered by the SFT renderer up to
`<|start|>assistant`, the generated tokens split into channels, final printed, analysis on request) or --raw.

The rendering and parsing are gptoss_cli/data/harmony.py's (`render_prompt`, `parse_completion`),
the same code `prepare-data --format harmony` trains on. A conversation may end with tool results
(`--messages`): the prompt continues the exchange, its analysis kept. A reply that ends in a tool call
(`<|call|>`) is described with the call's recipient, constraint and arguments (`tool_calls`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from gptoss_cli.json_input import parse_json
from gptoss_cli.data.conversation import parse_conversation
from gptoss_cli.data.harmony import (
    REASONING_EFFORTS, ConversationError, HarmonyTokenizer, Message, parse_completion, render_prompt,
)
from gptoss_cli.data.harmony_tools import tool_call_json
from gptoss_cli.errors import UsageError
from gptoss_cli.generate.decode import Generation
from gptoss_cli.generate.session import (
    HARMONY_STOP_TOKENS, RAW_STOP_TOKENS, Prompt, RawReplies, TextStream, raw_prompt, read_prompts_file,
    stop_token_ids,
)

FINAL = "final"


def harmony_tokenizer(tok, source: str) -> HarmonyTokenizer:
    """The renderer's view of the checkpoint's tokenizer; a tokenizer without harmony's tokens is a UsageError."""
    try:
        return HarmonyTokenizer(tok, source)
    except ConversationError as exc:
        raise UsageError(str(exc), hint="pass --raw for a plain-text prompt, "
                                        "or --tokenizer with the GPT-OSS tokenizer.json") from None


def prompt_conversation(text: str, *, system: str | None = None, developer: str | None = None,
                        reasoning_effort: str | None = None) -> dict[str, Any]:
    """One user turn as a conversation in harmony's JSON form: a system message (harmony's defaults, with
    `system` as the model identity and the reasoning effort when given), developer instructions, the user."""
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise UsageError(f"--reasoning-effort {reasoning_effort!r} is not one of {', '.join(REASONING_EFFORTS)}")
    system_content: dict[str, Any] = {"type": "system_content"}
    if reasoning_effort is not None:
        system_content["reasoning_effort"] = reasoning_effort
    if system is not None:
        system_content["model_identity"] = system
    messages = [{"role": "system", "content": [system_content]}]
    if developer is not None:
        messages.append({"role": "developer", "content": [{"type": "developer_content", "instructions": developer}]})
    messages.append({"role": "user", "content": text})
    return {"messages": messages}


def read_conversation_file(path: Path) -> dict[str, Any]:
    """--messages FILE: one conversation, a JSON object as one line of the SFT data holds it."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--messages {path}: no such file")
    try:
        return parse_json(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UsageError(f"--messages {path}: invalid UTF-8 ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--messages {path}: not JSON ({exc.msg} at line {exc.lineno})") from None


def _label(conv: dict[str, Any]) -> str:
    last_user = [m.get("content") for m in conv["messages"] if isinstance(m, dict) and m.get("role") == "user"]
    return last_user[-1] if last_user and isinstance(last_user[-1], str) else "(conversation)"


def harmony_prompt(htok: HarmonyTokenizer, conv: Any, where: str) -> Prompt:
    """The prompt ids of a conversation (ending with `<|start|>assistant`); `where` names it in errors."""
    try:
        messages = parse_conversation(conv)
    except ConversationError as exc:
        raise UsageError(f"{where}: {exc}",
                         hint='a conversation is {"messages": [{"role": ..., "content": ...}]}') from None
    return Prompt(_label(conv), render_prompt(messages, htok), {"messages": conv["messages"]})


def _message_json(m: Message) -> dict[str, Any]:
    return {"role": m.role, "channel": m.channel, "recipient": m.recipient, "content_type": m.content_type,
            "text": "".join(p for p in m.content if isinstance(p, str))}


class HarmonyReplies:
    """Decodes replies into channels: `describe` for the result, `streamer` for the terminal (the final
    channel to stdout; with show_analysis the other channels to stderr, each after a `[channel]` tag)."""

    def __init__(self, htok: HarmonyTokenizer, show_analysis: bool = False):
        self.htok, self.show_analysis = htok, show_analysis
        self.special = {v: k for k, v in htok.ids.items()}

    def _header_channel(self, header: list[int]) -> str | None:
        # the header of one message, parsed by the same parser as whole replies
        parsed = parse_completion(header + [self.htok.ids["message"], self.htok.ids["end"]], self.htok)
        return parsed[0].channel if parsed else None

    def streamer(self, write_out: Callable[[str], None], write_err: Callable[[str], None]) -> Callable[[int], None]:
        state: dict[str, Any] = {"header": [], "body": None, "target": None}

        def push(token_id: int) -> None:
            name = self.special.get(token_id)
            if state["body"] is None:
                if name == "start":
                    state["header"] = []
                elif name == "message":
                    channel = self._header_channel(state["header"])
                    state["body"] = TextStream(self.htok.tokenizer)
                    if channel == FINAL:
                        state["target"] = write_out
                    elif self.show_analysis:
                        state["target"] = write_err
                        write_err(f"[{channel or 'no channel'}] ")
                    else:
                        state["target"] = None
                else:
                    state["header"].append(token_id)
            elif name in ("end", "return", "call"):
                if state["target"] is write_err:
                    write_err("\n")
                state.update(header=[], body=None, target=None)
            else:
                text = state["body"].push(token_id)
                if text and state["target"] is not None:
                    state["target"](text)

        return push

    def describe(self, g: Generation) -> tuple[str, dict[str, Any]]:
        messages = parse_completion(g.output_ids, self.htok)
        channels: dict[str, str] = {}
        for m in messages:
            key = m.channel or "none"
            text = "".join(p for p in m.content if isinstance(p, str))
            channels[key] = channels[key] + "\n" + text if key in channels else text
        calls = [c for c in map(tool_call_json, messages) if c is not None]
        # a reply with no message text and no tool call did not parse as harmony (an untrained or
        # non-GPT-OSS model): its raw text is what there is to show
        harmony = any(text for text in channels.values()) or bool(calls)
        return channels.get(FINAL, ""), {"channels": channels, "reply_messages": [_message_json(m) for m in messages],
                                         "tool_calls": calls, "harmony": harmony,
                                         "raw_text": self.htok.decode(g.output_ids)}


def prepare_prompts(tok, tokenizer_file: str, *, raw: bool, prompt: str | None = None, messages: Path | None = None,
                    prompts: Path | None = None, system: str | None = None, developer: str | None = None,
                    reasoning_effort: str | None = None, show_analysis: bool = False):
    """(prompts, reply decoder, stop token ids) for exactly one of `prompt`, `messages` (a conversation
    file) or `prompts` (a JSONL file); `raw` renders nothing (plain text, no conversations)."""
    if raw:
        replies: Any = RawReplies(tok, stop_token_ids(tok, RAW_STOP_TOKENS))
        if prompt is not None:
            return [raw_prompt(tok, prompt)], replies, sorted(replies.stops)
        items = []
        for where, obj in read_prompts_file(prompts):
            if "prompt" not in obj:
                raise UsageError(f"{where}: --raw takes {{\"prompt\": ...}} lines, not conversations")
            items.append(raw_prompt(tok, obj["prompt"]))
        return items, replies, sorted(replies.stops)
    htok = harmony_tokenizer(tok, tokenizer_file)
    replies = HarmonyReplies(htok, show_analysis)
    options = dict(system=system, developer=developer, reasoning_effort=reasoning_effort)
    if prompt is not None:
        items = [harmony_prompt(htok, prompt_conversation(prompt, **options), "--prompt")]
    elif messages is not None:
        items = [harmony_prompt(htok, read_conversation_file(messages), f"--messages {messages}")]
    else:
        items = [harmony_prompt(htok, prompt_conversation(obj["prompt"], **options) if "prompt" in obj else obj, where)
                 for where, obj in read_prompts_file(prompts)]
    return items, replies, stop_token_ids(tok, HARMONY_STOP_TOKENS)
