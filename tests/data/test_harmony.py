"""The harmony renderer against openai-harmony itself, with the real GPT-OSS tokenizer: token ids, loss masks,
prompts and completion parsing, on conversations with Unicode, code, emoji, whitespace runs, tool calls and
several turns."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gptoss_cli.data.conversation import parse_conversation
from gptoss_cli.data.harmony import (
    ConversationError, HarmonyTokenizer, parse_completion, render_for_training, render_prompt,
)

h = pytest.importorskip("openai_harmony")
Role, Message, SystemContent, DeveloperContent, Author = h.Role, h.Message, h.SystemContent, h.DeveloperContent, h.Author
RETURN, END, CALL = 200002, 200007, 200012


def msg(role, text, channel=None, **kw):
    m = Message.from_role_and_content(role, text)
    if channel:
        m = m.with_channel(channel)
    if "recipient" in kw:
        m = m.with_recipient(kw["recipient"])
    if "content_type" in kw:
        m = m.with_content_type(kw["content_type"])
    return m


SYSTEM = msg(Role.SYSTEM, SystemContent.new().with_reasoning_effort(h.ReasoningEffort.HIGH)
             .with_conversation_start_date("2025-08-05"))
CODE = 'def f(xs):\n    """Sum."""\n\treturn  sum(x ** 2 for x in xs)   \n\n\n# done\n'
CONVERSATIONS = {
    "one-turn": [
        msg(Role.SYSTEM, SystemContent.new()), msg(Role.USER, "What is 2+2?"),
        msg(Role.ASSISTANT, "Simple arithmetic: 2+2=4.", "analysis"), msg(Role.ASSISTANT, "4", "final"),
    ],
    "unicode-code-emoji": [
        SYSTEM, msg(Role.DEVELOPER, DeveloperContent.new().with_instructions("Réponds en français 🇫🇷.\n  Be terse.")),
        msg(Role.USER, "Écris une fonction — « somme des carrés » 🤖 日本語も\n\n\n   ok?"),
        msg(Role.ASSISTANT, "L'utilisateur veut du code.   Espaces   multiples.\t\tTabs.", "analysis"),
        msg(Role.ASSISTANT, f"Voici :\n```python\n{CODE}```\n👩‍👩‍👧 fin.", "final"),
    ],
    "three-turns": [
        SYSTEM, msg(Role.USER, "hi"), msg(Role.ASSISTANT, "greet back", "analysis"), msg(Role.ASSISTANT, "Hello!", "final"),
        msg(Role.USER, "2nd <|end|> question with a literal special token"),
        msg(Role.ASSISTANT, "think two", "analysis"), msg(Role.ASSISTANT, "answer two", "final"),
        msg(Role.USER, "  third\r\n  "), msg(Role.ASSISTANT, "think three", "analysis"),
        msg(Role.ASSISTANT, "answer three ✓", "final"),
    ],
    "tool-call": [
        SYSTEM, msg(Role.USER, "Weather in Tokyo?"), msg(Role.ASSISTANT, "Need the weather tool.", "analysis"),
        msg(Role.ASSISTANT, '{"city": "Tokyo"}', "commentary", recipient="functions.get_weather",
            content_type="<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"temp": 21}')
        .with_channel("commentary").with_recipient("assistant"),
        msg(Role.ASSISTANT, "It is mild.", "analysis"), msg(Role.ASSISTANT, "21 °C in Tokyo.", "final"),
    ],
    "ends-with-a-call": [
        msg(Role.USER, "Hi"), msg(Role.ASSISTANT, "Hello", "final"), msg(Role.USER, "Run ls"),
        msg(Role.ASSISTANT, "Use the shell.", "analysis"),
        msg(Role.ASSISTANT, '{"cmd": "ls -la"}', "commentary", recipient="functions.shell", content_type="json"),
    ],
}


def as_json(messages) -> dict:
    return json.loads(h.Conversation.from_messages(messages).to_json())


def turns(messages):
    """[start, stop) of the runs of assistant messages (written here independently of the renderer)."""
    out, start = [], None
    for i, m in enumerate(messages + [None]):
        is_a = m is not None and m.author.role == Role.ASSISTANT
        if is_a and start is None:
            start = i
        if not is_a and start is not None:
            out.append((start, i))
            start = None
    return out


def expected(harmony, messages, analysis, train_on):
    """ids and mask from openai-harmony: the messages that stay (the chat template's rule: analysis of exchanges
    a final answer closed before the last exchange, everything after the last user message, is dropped; all
    analysis with "drop"; a tool call on the analysis channel is no chain of thought and stays), rendered by
    harmony; each trained turn's final <|end|> becomes <|return|>; the mask
    covers what follows harmony's own completion prompt (`render_conversation_for_completion(...,
    Role.ASSISTANT)`) through the turn's end. Trained turns: those of the last exchange, or all."""
    no_drop = h.RenderConversationConfig(auto_drop_analysis=False)
    ts = turns(messages)
    users = [i for i, m in enumerate(messages[:ts[-1][0]]) if m.author.role == Role.USER]
    exchange = users[-1] + 1 if users else 0
    finals = [i for i, m in enumerate(messages[:exchange]) if m.channel == "final"]
    cut = finals[-1] if finals else -1
    kept = [i for i, m in enumerate(messages[:ts[-1][1]])
            if not (m.channel == "analysis" and m.author.role == Role.ASSISTANT and m.recipient is None
                    and (analysis == "drop" or i < cut))]
    ids = harmony.render_conversation(h.Conversation.from_messages([messages[i] for i in kept]), no_drop)
    mask = [0] * len(ids)
    for a, b in (ts if train_on == "all" else [t for t in ts if t[0] >= exchange]):
        before = [messages[i] for i in kept if i < a]
        through = [messages[i] for i in kept if i < b]
        lo = len(harmony.render_conversation_for_completion(h.Conversation.from_messages(before), Role.ASSISTANT,
                                                            no_drop))
        hi = len(harmony.render_conversation(h.Conversation.from_messages(through), no_drop))
        mask[lo:hi] = [1] * (hi - lo)
        if ids[hi - 1] == END:
            ids[hi - 1] = RETURN
    return ids, mask


@pytest.mark.parametrize("train_on", ["last", "all"])
@pytest.mark.parametrize("analysis", ["keep", "drop"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_rendering_and_mask_match_openai_harmony(name, analysis, train_on, harmony, harmony_tok):
    messages = CONVERSATIONS[name]
    got = render_for_training(parse_conversation(as_json(messages)), harmony_tok, analysis=analysis, train_on=train_on)
    ids, mask = expected(harmony, messages, analysis, train_on)
    assert got.ids == ids, (harmony.decode(got.ids), harmony.decode(ids))
    assert got.mask == mask
    assert got.mask[0] == 0 and got.ids[-1] == (CALL if name == "ends-with-a-call" else RETURN) and got.mask[-1] == 1


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["", " ", "\n\n", "  \t x", "日本語", "🤖👩‍👩‍👧", "<|end|>", "don't", "1234567", "```py\nx = 1\n```"])


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(TEXT, min_size=9, max_size=9), turns_=st.integers(1, 3), thinking=st.lists(st.booleans(),
       min_size=3, max_size=3), analysis=st.sampled_from(["keep", "drop"]), train_on=st.sampled_from(["last", "all"]))
def test_random_text_renders_as_harmony_does(texts, turns_, thinking, analysis, train_on, harmony, harmony_tok):
    """Any Unicode (whitespace runs, emoji, CJK, special-token text) in any message: harmony's ids and masks."""
    messages = [msg(Role.SYSTEM, SystemContent.new())]
    for k in range(turns_):
        messages.append(msg(Role.USER, texts[3 * k]))
        if thinking[k]:
            messages.append(msg(Role.ASSISTANT, texts[3 * k + 1], "analysis"))
        messages.append(msg(Role.ASSISTANT, texts[3 * k + 2], "final"))
    got = render_for_training(parse_conversation(as_json(messages)), harmony_tok, analysis=analysis, train_on=train_on)
    assert (got.ids, got.mask) == expected(harmony, messages, analysis, train_on)


@pytest.mark.parametrize("name", ["one-turn", "unicode-code-emoji"])
def test_one_turn_matches_harmonys_training_render_directly(name, harmony, harmony_tok):
    """Where harmony's auto_drop_analysis means the same as --analysis (one turn): its own training render."""
    messages = CONVERSATIONS[name]
    conv = parse_conversation(as_json(messages))
    for analysis, auto_drop in (("keep", False), ("drop", True)):
        reference = harmony.render_conversation_for_training(
            h.Conversation.from_messages(messages), h.RenderConversationConfig(auto_drop_analysis=auto_drop))
        assert render_for_training(conv, harmony_tok, analysis=analysis).ids == reference


def test_two_turns_keep_matches_harmonys_auto_drop(harmony, harmony_tok):
    """Harmony drops the analysis before the first final answer; with two exchanges that is --analysis keep."""
    messages = CONVERSATIONS["three-turns"][:7]
    reference = harmony.render_conversation_for_training(h.Conversation.from_messages(messages))
    assert render_for_training(parse_conversation(as_json(messages)), harmony_tok).ids == reference


def test_trained_tokens_are_what_the_assistant_writes(harmony_tok):
    """The visible contract: the last answer and its <|return|> are trained, the prompt and the user are not."""
    r = render_for_training(parse_conversation(as_json(CONVERSATIONS["one-turn"])), harmony_tok)
    trained = harmony_tok.decode([t for t, m in zip(r.ids, r.mask) if m])
    assert trained == ("<|channel|>analysis<|message|>Simple arithmetic: 2+2=4.<|end|>"
                       "<|start|>assistant<|channel|>final<|message|>4<|return|>")
    dropped = render_for_training(parse_conversation(as_json(CONVERSATIONS["one-turn"])), harmony_tok, analysis="drop")
    assert harmony_tok.decode([t for t, m in zip(dropped.ids, dropped.mask) if m]) == \
        "<|channel|>final<|message|>4<|return|>"


def test_hugging_face_form_renders_as_the_equivalent_harmony_conversation(harmony, harmony_tok):
    """A system message becomes developer instructions, thinking the analysis, content the final answer; the
    date appears only when given."""
    hf = {"reasoning_effort": "low", "messages": [
        {"role": "system", "content": "Answer like a pirate."},
        {"role": "user", "content": "Where is the 宝 treasure? 🏴‍☠️"},
        {"role": "assistant", "thinking": "Earlier thought.", "content": "Arr, buried."},
        {"role": "user", "content": [{"type": "text", "text": "Where "}, {"type": "text", "text": "exactly?"}]},
        {"role": "assistant", "thinking": "They want   detail.\n", "content": "Under the palm,\n\n  matey."},
    ]}
    sys_content = SystemContent.new().with_reasoning_effort(h.ReasoningEffort.LOW)
    reference = [
        msg(Role.SYSTEM, sys_content),
        msg(Role.DEVELOPER, DeveloperContent.new().with_instructions("Answer like a pirate.")),
        msg(Role.USER, "Where is the 宝 treasure? 🏴‍☠️"), msg(Role.ASSISTANT, "Earlier thought.", "analysis"),
        msg(Role.ASSISTANT, "Arr, buried.", "final"), msg(Role.USER, "Where exactly?"),
        msg(Role.ASSISTANT, "They want   detail.\n", "analysis"), msg(Role.ASSISTANT, "Under the palm,\n\n  matey.", "final"),
    ]
    got = render_for_training(parse_conversation(hf), harmony_tok)
    assert got.ids == harmony.render_conversation_for_training(h.Conversation.from_messages(reference))
    assert "Current date" not in harmony_tok.decode(got.ids)
    dated = render_for_training(parse_conversation({**hf, "conversation_start_date": "2025-01-02"}), harmony_tok)
    reference[0] = msg(Role.SYSTEM, SystemContent.new().with_reasoning_effort(h.ReasoningEffort.LOW)
                       .with_conversation_start_date("2025-01-02"))
    assert dated.ids == harmony.render_conversation_for_training(h.Conversation.from_messages(reference))


def test_prompt_matches_harmonys_completion_render(harmony, harmony_tok):
    messages = CONVERSATIONS["three-turns"][:5]
    assert render_prompt(parse_conversation(as_json(messages)), harmony_tok) == \
        harmony.render_conversation_for_completion(h.Conversation.from_messages(messages), Role.ASSISTANT)


@pytest.mark.parametrize("name", ["tool-call", "unicode-code-emoji"])
def test_completion_parser_matches_harmonys(name, harmony, harmony_tok):
    """The generated part of a turn (after `<|start|>assistant`) parses into the same messages as harmony's parser."""
    messages = CONVERSATIONS[name]
    r = render_for_training(parse_conversation(as_json(messages)), harmony_tok, train_on="all")
    first = r.mask.index(1)
    end = first + r.mask[first:].index(0) if 0 in r.mask[first:] else len(r.ids)
    generated = r.ids[first:end]
    ours = parse_completion(generated, harmony_tok)
    theirs = harmony.parse_messages_from_completion_tokens(generated, Role.ASSISTANT)
    assert [(m.channel, m.recipient, m.content_type, m.content[0]) for m in ours] == \
        [(m.channel, m.recipient, m.content_type, m.content[0].text) for m in theirs]


def test_a_tokenizer_without_the_harmony_tokens_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    with pytest.raises(ConversationError, match=r"tok.json: no <\|start\|> token"):
        HarmonyTokenizer(Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")), "tok.json")


@pytest.mark.parametrize("conv, message", [
    ([1, 2], "not a conversation"),
    ({"text": "hello"}, "not a conversation"),
    ({"messages": []}, "no messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "message 0: unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "channel": "secret"}]},
     "message 1: unknown channel 'secret'"),
    ({"messages": [{"role": "user", "content": 5}]}, "message 0 content must be"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "message 0: a tool result with no tool call before it"),
    ({"messages": [{"role": "system", "content": "a"}], "developer": "b"}, "a second set of developer instructions"),
    ({"reasoning_effort": "extreme", "messages": []}, "no messages"),
    ({"reasoning_effort": "extreme", "messages": [{"role": "user", "content": "x"}]},
     "reasoning_effort 'extreme' is not one of"),
    ({"messages": [{"role": "system", "content": [{"type": "system_content", "tools": {"f": {}}}]}]},
     r"tools\['f'\] must be \{\"name\""),
    ({"messages": [{"role": "developer", "content": [{"type": "developer_content", "tools": {"functions": {
        "name": "functions", "tools": [{"name": "f", "description": "d", "parameters": [1]}]}}}]}]},
     r"tool 0 \(f\): parameters must be a JSON Schema object"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}], "messages": [
        {"role": "user", "content": "x"}]}, r"tools\[0\]: a tool needs a name"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"function": {}}]}]},
     r"message 1 tool_calls\[0\] needs a function name"),
    ({"builtin_tools": ["shell"], "messages": [{"role": "user", "content": "x"}]}, "builtin_tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}], "channel": "final"}]},
     "part of type 'image'"),
])
def test_bad_conversations_say_what_is_wrong(conv, message):
    with pytest.raises(ConversationError, match=message):
        parse_conversation(conv)


def test_a_conversation_without_an_assistant_turn_is_refused(harmony_tok):
    with pytest.raises(ConversationError, match="no assistant turn"):
        render_for_training(parse_conversation({"messages": [{"role": "user", "content": "x"}]}), harmony_tok)


def test_a_turn_that_is_only_analysis_cannot_be_trained_with_drop(harmony_tok):
    conv = {"messages": [{"role": "user", "content": "x"},
                         {"role": "assistant", "content": [{"type": "text", "text": "t"}], "channel": "analysis"}]}
    with pytest.raises(ConversationError, match="only analysis messages"):
        render_for_training(parse_conversation(conv), harmony_tok, analysis="drop")
    with pytest.raises(ConversationError, match="ends with a analysis message"):
        render_for_training(parse_conversation(conv), harmony_tok, analysis="keep")


def test_one_exchange_differs_from_harmonys_auto_drop_as_the_docs_say(harmony, harmony_tok):
    """docs/sft-data.md compares --analysis keep with harmony's default auto_drop_analysis: for one
    exchange they differ (harmony drops the only turn's analysis, keep trains it)."""
    from pathlib import Path

    messages = CONVERSATIONS["one-turn"]
    default = harmony.render_conversation_for_training(h.Conversation.from_messages(messages))
    assert render_for_training(parse_conversation(as_json(messages)), harmony_tok).ids != default
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "sft-data.md").read_text().split())
    assert "the same for two exchanges, not for one" in doc
