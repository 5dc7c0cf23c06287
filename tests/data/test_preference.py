"""Preference pairs rendered in harmony: each side token for token as openai-harmony renders the prompt and that
reply (reasoning effort in the system message, earlier analysis dropped, the last turn's channels and tool calls
trained), in TRL's explicit- and implicit-prompt forms, harmony's JSON form and the chat form, from JSONL and
Parquet; a pair whose prompt differs, with an empty side or identical sides is one line naming its row."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gptoss_cli.data.preference import parse_pair, render_pairs
from gptoss_cli.data.prepare.preference import prepare_preference
from gptoss_cli.data.token_format import check_token_files, read_token_header
from gptoss_cli.errors import UsageError
from tests.data.test_harmony import SYSTEM, as_json, expected, msg

h = pytest.importorskip("openai_harmony")
Role, Author = h.Role, h.Author

WEATHER = h.ToolDescription.new("get_weather", "Current weather in a city.", parameters={
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
DEVELOPER = msg(Role.DEVELOPER, h.DeveloperContent.new().with_instructions("Réponds en français si on te parle "
                                                                             "français.").with_function_tools([WEATHER]))
# (prompt, chosen, rejected) as openai-harmony messages
PAIRS = {
    "effort-analysis-languages": (
        [SYSTEM, DEVELOPER, msg(Role.USER, "Bonjour ! Quelle est la capitale du Japon ?"),
         msg(Role.ASSISTANT, "Simple géographie.", "analysis"), msg(Role.ASSISTANT, "Tokyo.", "final"),
         msg(Role.USER, "日本語で、もう一度？ 🗾")],
        [msg(Role.ASSISTANT, "The user switched to Japanese.", "analysis"), msg(Role.ASSISTANT, "東京です。", "final")],
        [msg(Role.ASSISTANT, "Tokyo, I said already.", "final")]),
    "tool-call-in-a-side": (
        [SYSTEM, DEVELOPER, msg(Role.USER, "Weather in Kraków, please — in °C.")],
        [msg(Role.ASSISTANT, "Need the weather tool.", "analysis"),
         msg(Role.ASSISTANT, '{"city": "Kraków"}', "commentary", recipient="functions.get_weather",
             content_type="<|constrain|>json"),
         h.Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"temp_c": 3}')
         .with_channel("commentary").with_recipient("assistant"),
         msg(Role.ASSISTANT, "3 °C, cold.", "final")],
        [msg(Role.ASSISTANT, "I cannot know the weather.", "final")]),
    "ends-with-a-call": (
        [msg(Role.SYSTEM, h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort.LOW)), DEVELOPER,
         msg(Role.USER, "¿Qué tiempo hace en Lima?")],
        [msg(Role.ASSISTANT, '{"city": "Lima"}', "commentary", recipient="functions.get_weather",
             content_type="<|constrain|>json")],
        [msg(Role.ASSISTANT, "Hace sol.", "final")]),
}


def messages_json(messages):
    return as_json(messages)["messages"] if messages else []


def explicit(name):
    prompt, chosen, rejected = PAIRS[name]
    return {"prompt": messages_json(prompt), "chosen": messages_json(chosen), "rejected": messages_json(rejected)}


def implicit(name):
    prompt, chosen, rejected = PAIRS[name]
    return {"chosen": as_json(prompt + chosen), "rejected": {"messages": messages_json(prompt + rejected)}}


@pytest.mark.parametrize("name", sorted(PAIRS))
@pytest.mark.parametrize("form", [explicit, implicit])
def test_both_sides_are_openai_harmonys_rendering_of_prompt_and_reply(name, form, harmony, harmony_tok):
    prompt, chosen, rejected = PAIRS[name]
    (pair,) = render_pairs([parse_pair(form(name))], harmony_tok)
    for side, reply in ((pair.chosen, chosen), (pair.rejected, rejected)):
        ids, mask = expected(harmony, prompt + reply, "keep", "last")
        assert (side.ids, side.mask) == (ids, mask), harmony.decode(side.ids)
    completion = harmony.render_conversation_for_completion(
        h.Conversation.from_messages(prompt), Role.ASSISTANT, h.RenderConversationConfig(auto_drop_analysis=False))
    dropped = [m for i, m in enumerate(prompt) if not (m.channel == "analysis" and i < 5)]  # earlier analysis: gone
    assert pair.prompt_tokens == len(harmony.render_conversation_for_completion(
        h.Conversation.from_messages(dropped), Role.ASSISTANT)) <= len(completion)


def test_the_trained_part_is_the_replys_channels_not_the_tool_result(harmony_tok):
    (pair,) = render_pairs([parse_pair(explicit("tool-call-in-a-side"))], harmony_tok)
    trained = harmony_tok.decode([t for t, m in zip(pair.chosen.ids, pair.chosen.mask) if m])
    assert trained.startswith("<|channel|>analysis<|message|>Need the weather tool.<|end|>")
    assert "to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{\"city\": \"Kraków\"}<|call|>" \
        in trained
    assert '{"temp_c": 3}' not in trained and trained.endswith("<|channel|>final<|message|>3 °C, cold.<|return|>")


def test_trls_chat_form_and_string_form_render_as_the_equivalent_harmony_conversation(harmony, harmony_tok):
    row = {"reasoning_effort": "high", "prompt": [{"role": "user", "content": "Combien font 2+2 ? 🤔"}],
           "chosen": [{"role": "assistant", "thinking": "Arithmétique.", "content": "4"}],
           "rejected": [{"role": "assistant", "content": "5"}]}
    system = msg(Role.SYSTEM, h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort.HIGH))
    user = msg(Role.USER, "Combien font 2+2 ? 🤔")
    (pair,) = render_pairs([parse_pair(row)], harmony_tok)
    keep = h.RenderConversationConfig(auto_drop_analysis=False)  # the last turn's analysis is trained
    assert pair.chosen.ids == harmony.render_conversation_for_training(h.Conversation.from_messages(
        [system, user, msg(Role.ASSISTANT, "Arithmétique.", "analysis"), msg(Role.ASSISTANT, "4", "final")]), keep)
    assert pair.rejected.ids == harmony.render_conversation_for_training(
        h.Conversation.from_messages([system, user, msg(Role.ASSISTANT, "5", "final")]))
    (plain,) = render_pairs([parse_pair({"prompt": "Combien font 2+2 ? 🤔", "chosen": "4", "rejected": "5",
                                         "reasoning_effort": "high"})], harmony_tok)
    assert plain.rejected.ids == pair.rejected.ids


@pytest.fixture(scope="module")
def tiny_tokenizer_file(tmp_path_factory):
    """make-tiny's small harmony tokenizer: the checks do not depend on the vocabulary, and it loads at once."""
    from gptoss_cli.data.tiny_tokenizer import tiny_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(json.dumps(tiny_tokenizer(1003)))
    return path


@pytest.mark.parametrize("row,why", [
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
      "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}]},
     "the prompt differs between the chosen and rejected sides"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [], "rejected": [{"role": "assistant", "content": "y"}]},
     "the chosen side is empty"),
    ({"prompt": "a", "chosen": "same", "rejected": "same"}, "the chosen and rejected sides are identical"),
    ({"prompt": "a", "chosen": "x"}, "not a preference pair"),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
      "rejected": [{"role": "user", "content": "a"}]}, "the rejected side: the conversation has no assistant turn"),
])
def test_a_bad_pair_is_one_line_naming_the_row(row, why, tmp_path, tiny_tokenizer_file):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "chosen": "yes", "rejected": "no"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(UsageError) as err:
        prepare_preference([path], tmp_path / "out", tiny_tokenizer_file)
    assert f"{path}:2: {why}" in err.value.message and "\n" not in err.value.message
    assert not list(tmp_path.glob("out*"))  # nothing half-written
    result = prepare_preference([path], tmp_path / "out", tiny_tokenizer_file, errors="skip")
    assert (result.details["num_pairs"], result.num_skipped) == (1, 1) and why in result.skipped[0]


def test_parquet_and_jsonl_give_the_same_paired_token_file(tmp_path, gpt_oss_tokenizer_file):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = [{"prompt": [{"role": "user", "content": f"Question {k} — réponse ?"}],
             "chosen": [{"role": "assistant", "thinking": "Réfléchir." if k % 2 else None, "content": f"Oui {k}"}],
             "rejected": [{"role": "assistant", "thinking": None, "content": f"Non {k}"}],
             "reasoning_effort": ["low", "medium", "high"][k]} for k in range(3)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "nested.parquet", row_group_size=2)
    got = {}
    for name in ("pairs.jsonl", "nested.parquet"):
        prefix = tmp_path / name.split(".")[0]
        prepare_preference([tmp_path / name], prefix, gpt_oss_tokenizer_file, seq_length=2048)
        got[name] = [prefix.with_suffix(s).read_bytes() for s in (".bin", ".idx", ".mask")]
    assert got["pairs.jsonl"] == got["nested.parquet"]
    header = read_token_header(tmp_path / "pairs")
    assert header["kind"] == "preference" and header["num_documents"] == 6 and header["packing"]["rows"] >= 1
    offsets = np.fromfile(tmp_path / "pairs.idx", dtype="<i8")
    mask = np.fromfile(tmp_path / "pairs.mask", dtype="u1")
    assert all(mask[a] == 0 and mask[a:b].any() for a, b in zip(offsets[:-1], offsets[1:]))
    check_token_files(tmp_path / "pairs", 201088)


def test_max_length_bounds_a_pair_and_drops_longer_ones(tmp_path, gpt_oss_tokenizer_file):
    rows = [{"prompt": "Hi", "chosen": "Hello!", "rejected": "No."},
            {"prompt": "Hi " * 200, "chosen": "Hello!", "rejected": "No."}]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = prepare_preference([tmp_path / "pairs.jsonl"], tmp_path / "out", gpt_oss_tokenizer_file, seq_length=400)
    assert (result.details["num_pairs"], result.details["num_dropped"]) == (1, 1)
    assert result.details["max_pair_length"] <= 400
