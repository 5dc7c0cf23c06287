"""Agent traces against openai-harmony: tool definitions (function tools with nested objects, enums, optional
fields, defaults; the built-in browser and python tools), tool calls and results (several per turn, errors,
Unicode arguments, a result that spells special tokens), their token ids and loss masks, prompts that continue
after a tool result, the Hugging Face chat form with tools; and a hypothesis test over generated schemas and
call sequences. The reference ids and masks are `expected()` of tests/data/test_harmony.py (harmony's own
renders); the tools' TypeScript text is harmony's, never ours."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gptoss_cli.data.conversation import parse_conversation, parse_prompt
from gptoss_cli.data.harmony import ConversationError, parse_completion, render_for_training, render_prompt
from gptoss_cli.data.harmony import Message as Message_
from gptoss_cli.data.harmony_tools import tool_call_json
from tests.data.test_harmony import CALL, RETURN, as_json, expected, msg

h = pytest.importorskip("openai_harmony")
Role, Message, SystemContent, DeveloperContent, Author = h.Role, h.Message, h.SystemContent, h.DeveloperContent, h.Author

WEATHER = h.ToolDescription.new("get_weather", "Gets the current weather.\nUse metric units.", parameters={
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country, e.g. 東京, Japan"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "integer", "description": "forecast days", "default": 1},
        "details": {"type": "object", "description": "what to include", "properties": {
            "wind": {"type": "boolean"}, "hours": {"type": "array", "items": {"type": "number"}}},
            "required": ["wind"]},
        "threshold": {"type": "number", "default": 0.5, "nullable": True},
        "when": {"oneOf": [{"type": "string", "description": "ISO date"}, {"type": "integer"}]},
    },
    "required": ["location"],
})
SEARCH = h.ToolDescription.new("search_docs", "Searches the docs.", parameters={
    "type": "object", "required": ["query"], "properties": {
        "query": {"type": "string"}, "k": {"type": "integer"},
        # serde_json (harmony) reads this float one unit in the last place off: 2.0324116564254335e23
        "boost": {"type": "number", "default": 2.0324116564254338e+23}}})
PING = h.ToolDescription.new("ping", "No arguments.\r\nNone at all.\r")  # Rust's lines(): only \r\n ends a line
DEV_TOOLS = msg(Role.DEVELOPER, DeveloperContent.new().with_instructions("Use tools when useful.")
                .with_function_tools([WEATHER, SEARCH, PING]))
SYSTEM = msg(Role.SYSTEM, SystemContent.new().with_conversation_start_date("2025-08-05"))
BUILTIN_SYSTEM = msg(Role.SYSTEM, SystemContent.new().with_reasoning_effort(h.ReasoningEffort.LOW)
                     .with_browser_tool().with_python_tool())


def call(name, args, channel="commentary", content_type="<|constrain|>json"):
    return msg(Role.ASSISTANT, args, channel, recipient=name, content_type=content_type)


def result(name, text, channel="commentary"):
    return Message.from_author_and_content(Author.new(Role.TOOL, name), text).with_channel(channel) \
        .with_recipient("assistant")


TOOL_CONVERSATIONS = {
    "function-call": [
        SYSTEM, DEV_TOOLS, msg(Role.USER, "Weather in Tokyo?"), msg(Role.ASSISTANT, "Need the tool.", "analysis"),
        call("functions.get_weather", '{"location": "東京, Japan", "unit": "celsius"}'),
        result("functions.get_weather", '{"temp_c": 21, "sky": "☀️ clear"}'),
        msg(Role.ASSISTANT, "21C, clear.", "analysis"), msg(Role.ASSISTANT, "21 °C and clear in Tokyo.", "final"),
    ],
    "builtin-tools": [
        BUILTIN_SYSTEM, msg(Role.USER, "Population of Lyon times 2?"),
        msg(Role.ASSISTANT, "Search first.", "analysis"),
        call("browser.search", '{"query": "Lyon population", "topn": 3}', "analysis", "code"),
        result("browser.search", "【0†Lyon - Wikipedia】 population 522,250", "analysis"),
        call("python", "print(522250 * 2)", "analysis", "code"), result("python", "1044500", "analysis"),
        msg(Role.ASSISTANT, "About 1,044,500.", "final"),
    ],
    "several-calls-and-errors": [
        SYSTEM, DEV_TOOLS, msg(Role.USER, "Compare Paris and Oslo weather, and ping."),
        msg(Role.ASSISTANT, "Two lookups.", "analysis"),
        msg(Role.ASSISTANT, "Checking both cities now.", "commentary"),  # a preamble
        call("functions.get_weather", '{"location": "Paris"}'),
        call("functions.get_weather", '{"location": "Oslo", "details": {"wind": true, "hours": [1.5, 2.5]}}'),
        result("functions.get_weather", '{"temp_c": 18}'),
        result("functions.get_weather", "Error: upstream timeout after 30s"),
        msg(Role.ASSISTANT, "Oslo failed; retry.", "analysis"),
        call("functions.get_weather", '{"location": "Oslo"}'), result("functions.get_weather", '{"temp_c": 9}'),
        call("functions.ping", "{}"), result("functions.ping", "pong"),
        msg(Role.ASSISTANT, "Paris 18 °C, Oslo 9 °C.", "final"),
    ],
    "result-spells-special-tokens": [
        SYSTEM, DEV_TOOLS, msg(Role.USER, "Search the docs for the end token."),
        call("functions.search_docs", '{"query": "<|end|> and <|call|>", "k": 2}'),
        result("functions.search_docs", "Harmony ends a call with <|call|> and a message with <|end|><|return|>."),
        msg(Role.ASSISTANT, "It is <|call|>.", "final"),
    ],
    "two-exchanges": [
        SYSTEM, DEV_TOOLS, msg(Role.USER, "Weather in Rome?"), msg(Role.ASSISTANT, "tool", "analysis"),
        call("functions.get_weather", '{"location": "Rome"}'), result("functions.get_weather", '{"temp_c": 25}'),
        msg(Role.ASSISTANT, "warm", "analysis"), msg(Role.ASSISTANT, "25 °C.", "final"),
        msg(Role.USER, "And Milan?"), msg(Role.ASSISTANT, "again", "analysis"),
        call("functions.get_weather", '{"location": "Milan"}'), result("functions.get_weather", '{"temp_c": 23}'),
        msg(Role.ASSISTANT, "23 °C.", "final"),
    ],
    "ends-with-a-call": [
        SYSTEM, DEV_TOOLS, msg(Role.USER, "Hi"), msg(Role.ASSISTANT, "Hello", "final"), msg(Role.USER, "Ping it"),
        msg(Role.ASSISTANT, "Ping.", "analysis"), call("functions.ping", "{}"),
        result("functions.ping", "pong"),  # after the last trained turn: left out
    ],
}


@pytest.mark.parametrize("train_on", ["last", "all"])
@pytest.mark.parametrize("analysis", ["keep", "drop"])
@pytest.mark.parametrize("name", sorted(TOOL_CONVERSATIONS))
def test_agent_traces_render_and_mask_as_openai_harmony(name, analysis, train_on, harmony, harmony_tok):
    messages = TOOL_CONVERSATIONS[name]
    got = render_for_training(parse_conversation(as_json(messages)), harmony_tok, analysis=analysis, train_on=train_on)
    ids, mask = expected(harmony, messages, analysis, train_on)
    assert got.ids == ids, (harmony.decode(got.ids), harmony.decode(ids))
    assert got.mask == mask
    assert got.ids[-1] == (CALL if name == "ends-with-a-call" else RETURN) and got.mask[-1] == 1


@pytest.mark.parametrize("name", ["function-call", "builtin-tools", "several-calls-and-errors",
                                  "result-spells-special-tokens"])
def test_one_exchange_is_harmonys_training_render(name, harmony, harmony_tok):
    """One exchange, analysis kept: the document is exactly render_conversation_for_training."""
    messages = TOOL_CONVERSATIONS[name]
    reference = harmony.render_conversation_for_training(h.Conversation.from_messages(messages),
                                                         h.RenderConversationConfig(auto_drop_analysis=False))
    assert render_for_training(parse_conversation(as_json(messages)), harmony_tok).ids == reference


def test_every_assistant_message_of_the_last_exchange_is_trained_and_no_tool_result(harmony_tok):
    """The visible contract of --train-on last on an agent trace: calls (through <|call|>), analysis, the preamble
    and the answer are trained; the tool results, the user and the headers before each turn are not."""
    r = render_for_training(parse_conversation(as_json(TOOL_CONVERSATIONS["several-calls-and-errors"])), harmony_tok)
    runs, run = [], []
    for t, m in zip(r.ids, r.mask):
        if m:
            run.append(t)
        elif run:
            runs.append(harmony_tok.decode(run))
            run = []
    runs.append(harmony_tok.decode(run))
    assert runs == [
        "<|channel|>analysis<|message|>Two lookups.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking "
        "both cities now.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"location": "Paris"}<|call|><|start|>assistant to=functions.get_weather<|channel|>commentary '
        '<|constrain|>json<|message|>{"location": "Oslo", "details": {"wind": true, "hours": [1.5, 2.5]}}<|call|>',
        "<|channel|>analysis<|message|>Oslo failed; retry.<|end|><|start|>assistant to=functions.get_weather<|channel|>"
        'commentary <|constrain|>json<|message|>{"location": "Oslo"}<|call|>',
        ' to=functions.ping<|channel|>commentary <|constrain|>json<|message|>{}<|call|>',
        "<|channel|>final<|message|>Paris 18 °C, Oslo 9 °C.<|return|>",
    ]


@pytest.mark.parametrize("name, stop, dropped", [("function-call", 6, []), ("several-calls-and-errors", 9, []),
                                                 ("builtin-tools", 7, []), ("two-exchanges", 12, [3, 6])])
def test_a_prompt_after_tool_results_is_harmonys_completion_render(name, stop, dropped, harmony, harmony_tok):
    """generate continues after a tool result: the prompt is render_conversation_for_completion's, the analysis
    of the exchange under way kept. The analysis of an exchange a final answer closed is dropped (the chat
    template's rule; harmony drops it only when the conversation's last assistant message is final)."""
    messages = TOOL_CONVERSATIONS[name][:stop]
    assert messages[-1].author.role == Role.TOOL
    prompt = parse_prompt(as_json(messages))
    assert all(messages[i].channel == "analysis" for i in dropped)
    kept = [m for i, m in enumerate(messages) if i not in dropped]
    assert render_prompt(prompt.messages, harmony_tok) == harmony.render_conversation_for_completion(
        h.Conversation.from_messages(kept), Role.ASSISTANT)


def test_a_prompt_record_keeps_its_other_fields_and_refuses_an_answered_conversation():
    record = {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4", "tests": [1, 2]}
    prompt = parse_prompt(record)
    assert [m.role for m in prompt.messages] == ["system", "user"] and prompt.extra == {"answer": "4", "tests": [1, 2]}
    with pytest.raises(ConversationError, match="ends with an assistant reply"):
        parse_prompt({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]})


def test_a_generated_tool_call_parses_as_harmony_parses_it(harmony, harmony_tok):
    """What the model writes up to its first <|call|> (where generation stops): harmony's messages, and the
    call's recipient, constraint and arguments."""
    messages = TOOL_CONVERSATIONS["several-calls-and-errors"]
    r = render_for_training(parse_conversation(as_json(messages)), harmony_tok)
    first = r.mask.index(1)
    generated = r.ids[first:r.ids.index(CALL, first) + 1]
    ours = parse_completion(generated + [RETURN], harmony_tok)
    theirs = harmony.parse_messages_from_completion_tokens(generated, Role.ASSISTANT)
    assert [(m.channel, m.recipient, m.content_type, m.content[0]) for m in ours] == \
        [(m.channel, m.recipient, m.content_type, m.content[0].text) for m in theirs]
    assert tool_call_json(ours[-1]) == {
        "recipient": "functions.get_weather", "namespace": "functions", "name": "get_weather", "channel": "commentary",
        "content_type": "<|constrain|>json", "constraint": "json", "arguments": {"location": "Paris"},
        "arguments_text": '{"location": "Paris"}'}
    assert tool_call_json(ours[0]) is None  # the analysis is no call
    bad = tool_call_json(Message_(role="assistant", content=("{oops",), channel="commentary", recipient="functions.f",
                                  content_type="<|constrain|>json"))
    assert bad["arguments"] is None and bad["arguments_error"].startswith("not JSON")


# ------------------------------------------------------------------------------ the chat form with tools

HF_TOOLS = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               **({"parameters": t.parameters} if t.parameters else {})}}
            for t in (WEATHER, SEARCH, PING)]


HF_SEVERAL_CALLS = {"developer": "Use tools when useful.", "conversation_start_date": "2025-08-05", "tools": HF_TOOLS,
      "messages": [
          {"role": "user", "content": "Compare Paris and Oslo weather, and ping."},
          {"role": "assistant", "thinking": "Two lookups.", "content": "Checking both cities now.", "tool_calls": [
              {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": {"location": "Paris"}}},
              {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments":
                                                           '{"location": "Oslo", "details": {"wind": true, '
                                                           '"hours": [1.5, 2.5]}}'}}]},
          {"role": "tool", "tool_call_id": "a", "content": {"temp_c": 18}},
          {"role": "tool", "content": "Error: upstream timeout after 30s"},
          {"role": "assistant", "thinking": "Oslo failed; retry.", "tool_calls": [
              {"function": {"name": "get_weather", "arguments": {"location": "Oslo"}}}]},
          {"role": "tool", "name": "get_weather", "content": [{"type": "text", "text": '{"temp_c": 9}'}]},
          {"role": "assistant", "tool_calls": [{"name": "ping", "arguments": {}}]},
          {"role": "tool", "content": "pong"},
          {"role": "assistant", "content": "Paris 18 °C, Oslo 9 °C."},
      ]}


def test_hugging_face_chat_form_with_tools_is_the_equivalent_harmony_conversation(harmony, harmony_tok):
    """tools -> the developer message's functions namespace; tool_calls -> commentary calls with
    <|constrain|>json (each call its own message); thinking -> analysis; content beside tool_calls -> analysis
    (with thinking too: a commentary preamble); role tool -> a result named by its call (id, name or order)."""
    reference = TOOL_CONVERSATIONS["several-calls-and-errors"]
    ours = parse_conversation(HF_SEVERAL_CALLS)
    for analysis in ("keep", "drop"):
        got = render_for_training(ours, harmony_tok, analysis=analysis)
        assert (got.ids, got.mask) == expected(harmony, reference, analysis, "last"), analysis


def test_builtin_tools_in_the_chat_form(harmony, harmony_tok):
    hf = {"reasoning_effort": "low", "builtin_tools": ["python", "browser"], "messages": [
        {"role": "user", "content": "Population of Lyon times 2?"},
        {"role": "assistant", "thinking": "Search first.", "tool_calls": [
            {"function": {"name": "browser.search", "arguments": {"query": "Lyon population", "topn": 3}}}]},
        {"role": "tool", "content": "【0†Lyon - Wikipedia】 population 522,250"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "python", "arguments": "print(522250 * 2)"}}]},
        {"role": "tool", "name": "python", "content": "1044500"},
        {"role": "assistant", "content": "About 1,044,500."}]}
    got = render_for_training(parse_conversation(hf), harmony_tok)
    assert (got.ids, got.mask) == expected(harmony, TOOL_CONVERSATIONS["builtin-tools"], "keep", "last")


# ------------------------------------------------------------------- generated schemas and call sequences

NAMES = st.text(st.characters(categories=("Ll", "Lu", "Nd"), max_codepoint=0x7F), min_size=1, max_size=8).map(
    lambda s: "p" + s)
WORDS = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20) | st.sampled_from(
    ["", "東京 🌧", "<|call|>", "line one\nline two", "a\r\nb", " spaced  out "])
DEFAULTS = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False,
                                                                            width=64) | WORDS


def _schemas(depth: int):
    scalar = st.fixed_dictionaries({"type": st.sampled_from(["string", "number", "integer", "boolean"])}, optional={
        "description": WORDS, "default": DEFAULTS, "nullable": st.booleans()})
    enum = st.fixed_dictionaries({"type": st.just("string"), "enum": st.lists(WORDS, min_size=1, max_size=3)},
                                 optional={"default": WORDS})
    array = st.fixed_dictionaries({"type": st.just("array")}, optional={"items": scalar})
    union = st.fixed_dictionaries({"oneOf": st.lists(scalar, min_size=1, max_size=3)}, optional={
        "description": WORDS, "default": DEFAULTS})
    leaves = scalar | enum | array | union | st.fixed_dictionaries({"type": st.lists(
        st.sampled_from(["string", "integer", "null"]), min_size=1, max_size=2)})
    return leaves if depth == 0 else leaves | _objects(depth - 1)


def _objects(depth: int):
    return st.dictionaries(NAMES, _schemas(depth), max_size=4).flatmap(lambda props: st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.just(props),
         "required": st.lists(st.sampled_from(sorted(props)), unique=True) if props else st.just([])},
        optional={"description": WORDS}))


TOOLS = st.lists(st.tuples(NAMES, WORDS, st.none() | _objects(1)), min_size=1, max_size=3,
                 unique_by=lambda t: t[0])
ARGS = st.dictionaries(NAMES, st.integers() | WORDS | st.lists(st.booleans(), max_size=2), max_size=3)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(tools=TOOLS, steps=st.lists(st.tuples(st.booleans(), st.integers(0, 2), ARGS, WORDS), min_size=1, max_size=3),
       answer=WORDS, analysis=st.sampled_from(["keep", "drop"]), train_on=st.sampled_from(["last", "all"]),
       data=st.data())
def test_generated_tools_and_call_sequences_render_as_harmony_does(tools, steps, answer, analysis, train_on, data,
                                                                   harmony, harmony_tok):
    """Any tool schemas (nested objects, enums, unions, defaults of every JSON type, Unicode everywhere) and any
    sequence of exchanges with analysis, several calls in a row and results: harmony's ids and masks."""
    described = [h.ToolDescription.new(name, desc, parameters=params) for name, desc, params in tools]
    messages = [SYSTEM, msg(Role.DEVELOPER, DeveloperContent.new().with_function_tools(described))]
    for k, (think, n_calls, args, text) in enumerate(steps):
        messages.append(msg(Role.USER, text))
        if think:
            messages.append(msg(Role.ASSISTANT, text, "analysis"))
        names = [data.draw(st.sampled_from([t[0] for t in tools])) for _ in range(n_calls)]
        messages += [call(f"functions.{n}", json.dumps(args, ensure_ascii=False)) for n in names]
        messages += [result(f"functions.{n}", text) for n in names]
        messages.append(msg(Role.ASSISTANT, answer, "final"))
    got = render_for_training(parse_conversation(as_json(messages)), harmony_tok, analysis=analysis, train_on=train_on)
    assert (got.ids, got.mask) == expected(harmony, messages, analysis, train_on)
