"""The Hugging Face chat form with tools against transformers' rendering of the real GPT-OSS chat template (the
`chat_template.jinja` the gpt-oss checkpoints ship, as TRL's wheel carries it byte for byte in
trl/chat_templates/gptoss.jinja for identity checks: offline, no download).

Where the template is right, our tokens are its tokens (its text tokenized by the HF tokenizer, special
tokens parsed). Where it is not (docs/sft-data.md lists it), each difference is asserted here, so the list
stays true: the missing <|constrain|>, tool results and string arguments JSON-quoted a second time, only the
first of several calls rendered, the analysis before an answered exchange's calls dropped, tool definitions
with defaults or nested objects, today's date, the developer message's trailing blank line."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from gptoss_cli.data.conversation import parse_conversation
from gptoss_cli.data.harmony import render_for_training

trl = pytest.importorskip("trl", reason="the test extra installs trl (it ships the gpt-oss chat template)")
TEMPLATE = (Path(trl.__file__).parent / "chat_templates" / "gptoss.jinja").read_text()

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Gets the weather.", "parameters": {
    "type": "object", "required": ["location"], "properties": {
        "location": {"type": "string", "description": "The city"}, "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
        "hourly": {"type": "boolean"}}}}}
PING = {"type": "function", "function": {"name": "ping", "description": "Ping."}}


def call(name, args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


AGENT_TRACE = [
    {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [call("get_weather", {"location": "Paris", "unit": "c"})]},
    {"role": "tool", "content": {"temp": 18, "sky": "clear ☀"}},
    {"role": "assistant", "thinking": "Mild.", "content": "18 °C."},
    {"role": "user", "content": "And Oslo? Then ping."},
    {"role": "assistant", "tool_calls": [call("get_weather", {"location": "Oslo", "tags": ["wind", "雨"]})]},
    {"role": "tool", "content": {"temp": 9}},
    {"role": "assistant", "tool_calls": [call("ping", {})]}, {"role": "tool", "content": {"ok": True}},
    {"role": "assistant", "thinking": "Cold.", "content": "9 °C in Oslo; ping ok."},
]


@pytest.fixture(scope="module")
def hf_tokenizer(gpt_oss_tokenizer_file):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(gpt_oss_tokenizer_file))


def template(hf_tokenizer, messages, tools=None, **kwargs) -> str:
    return hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=TEMPLATE, **kwargs)


def ours(harmony_tok, messages, tools=None, **fields) -> str:
    today = datetime.date.today().strftime("%Y-%m-%d")  # the template always writes today's date
    conv = {"messages": messages, "conversation_start_date": today, **({"tools": tools} if tools else {}), **fields}
    return harmony_tok.decode(render_for_training(parse_conversation(conv), harmony_tok).ids)


@pytest.mark.parametrize("kwargs", [{}, {"reasoning_effort": "low", "builtin_tools": ["browser", "python"]}],
                         ids=["functions", "functions-and-builtins"])
def test_where_the_template_is_right_its_tokens_are_ours(kwargs, hf_tokenizer, harmony_tok):
    """Function tools with plain schemas, one call per message, JSON tool results, two exchanges (the first one's
    analysis dropped): the template's tokens, once its tool calls get harmony's <|constrain|> before json."""
    text = template(hf_tokenizer, AGENT_TRACE, [WEATHER, PING], **kwargs)
    fixed = text.replace("<|channel|>commentary json<|message|>", "<|channel|>commentary <|constrain|>json<|message|>")
    assert fixed.count("<|constrain|>") == 3
    mine = ours(harmony_tok, AGENT_TRACE, [WEATHER, PING], **kwargs)
    assert mine == fixed
    got = render_for_training(parse_conversation({"messages": AGENT_TRACE, "tools": [WEATHER, PING], **kwargs,
                                                  "conversation_start_date": datetime.date.today().isoformat()}),
                              harmony_tok).ids
    assert got == hf_tokenizer.encode(fixed, add_special_tokens=False)


USER = {"role": "user", "content": "Ping twice."}
DIFFERENCES = {
    # name: (messages, tools, in the template's text, in ours)
    "string-tool-result": (
        [USER, {"role": "assistant", "tool_calls": [call("ping", {})]}, {"role": "tool", "content": "pong"},
         {"role": "assistant", "content": "ok"}], [PING],
        '<|message|>"pong"<|end|>', "<|message|>pong<|end|>"),
    "string-arguments": (
        [USER, {"role": "assistant", "tool_calls": [call("ping", '{"n": 1}')]}, {"role": "tool", "content": {}},
         {"role": "assistant", "content": "ok"}], [PING],
        '<|message|>"{\\"n\\": 1}"<|call|>', '<|message|>{"n": 1}<|call|>'),
    "several-calls-in-one-message": (
        [USER, {"role": "assistant", "tool_calls": [call("ping", {"n": 1}), call("ping", {"n": 2})]},
         {"role": "tool", "content": {}}, {"role": "tool", "content": {}}, {"role": "assistant", "content": "ok"}],
        [PING], None, '{"n": 2}<|call|>'),
    "analysis-before-a-call-of-the-last-exchange": (
        [USER, {"role": "assistant", "thinking": "I should ping.", "tool_calls": [call("ping", {})]},
         {"role": "tool", "content": {}}, {"role": "assistant", "content": "ok"}], [PING],
        None, "<|channel|>analysis<|message|>I should ping.<|end|>"),
    "parameter-default": (
        [USER, {"role": "assistant", "content": "ok"}],
        [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "default": 3}}}}}],
        "n?: number, // default: 3,\n", "n?: number, // default: 3\n"),
    "nested-object": (
        [USER, {"role": "assistant", "content": "ok"}],
        [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
            "type": "object", "properties": {"o": {"type": "object", "properties": {"a": {"type": "string"}}}}}}}],
        "o?: {\na?: \n                string},", "o?: {\n    a?: string,\n    },"),
    "multi-line-description": (
        [USER, {"role": "assistant", "content": "ok"}],
        [{"type": "function", "function": {"name": "f", "description": "line one\nline two"}}],
        "// line one\nline two\ntype f", "// line one\n// line two\ntype f"),
    "developer-instructions-without-tools": (
        [{"role": "system", "content": "Be terse."}, USER, {"role": "assistant", "content": "ok"}], None,
        "Be terse.\n\n<|end|>", "Be terse.<|end|>"),
}


@pytest.mark.parametrize("name", sorted(DIFFERENCES))
def test_where_the_template_is_wrong_we_follow_harmony(name, hf_tokenizer, harmony_tok):
    messages, tools, theirs_has, ours_has = DIFFERENCES[name]
    text, mine = template(hf_tokenizer, messages, tools), ours(harmony_tok, messages, tools)
    assert ours_has in mine and ours_has not in text
    if theirs_has is not None:
        assert theirs_has in text and theirs_has not in mine


def test_the_template_writes_todays_date_we_only_a_given_one(hf_tokenizer, harmony_tok):
    messages = [USER, {"role": "assistant", "content": "ok"}]
    today = datetime.date.today().strftime("%Y-%m-%d")
    assert f"Current date: {today}" in template(hf_tokenizer, messages)
    undated = harmony_tok.decode(render_for_training(parse_conversation({"messages": messages}), harmony_tok).ids)
    assert "Current date" not in undated
