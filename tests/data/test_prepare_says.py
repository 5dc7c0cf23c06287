"""What `prepare-data` says (issue 53): `--format harmony` says why it dropped each conversation it dropped, a
count per reason and the first rows, each with its length or its first trained token, checked against the same
conversations rendered without any limit, and a file of which nothing is left names the reason and the fix;
plain prepare-data on conversations points at --format harmony."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest

from gptoss_cli.data.tiny_tokenizer import tiny_tokenizer
from gptoss_cli.model.config import preset
from tests.support.cli import run_cli

pytest.importorskip("tokenizers")
prepare = partial(run_cli, "prepare-data", "--format", "harmony")
TOO_LONG, NOTHING_TRAINED = "longer_than_max_length", "no_trained_token_before_the_cut"  # --json's reasons

PLAIN = {"messages": [{"role": "user", "content": "What is 2 plus 3?"},
                      {"role": "assistant", "content": "2 plus 3 is 5."}]}
TOOL = {"tools": [{"type": "function", "function": {
    "name": "get_weather", "description": "Gets the weather.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}],
    "messages": [{"role": "user", "content": "Weather in Tokyo?"},
                 {"role": "assistant", "thinking": "Use the tool.", "tool_calls": [
                     {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": {"location": "Tokyo"}}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": {"temp": 21}},
                 {"role": "assistant", "content": "21 °C."}]}


def dropped_rows(chats, tok, out, **options) -> list[str]:
    """The `dropped` rows of the summary table the command prints (the table wraps long cells at the
    terminal's width, so they are read from the result it renders)."""
    from gptoss_cli.data.prepare.conversations import prepare_conversations

    result = prepare_conversations([chats], out, tok, **options)
    return [value for label, value in result.summary if label == "dropped"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(tokenizer.json, conversations.jsonl: plain, tool, plain, tool, its documents rendered without a limit)."""
    root = tmp_path_factory.mktemp("drops")
    tok = root / "tokenizer.json"
    tok.write_text(json.dumps(tiny_tokenizer(preset("tiny").vocab_size)))
    chats = root / "conversations.jsonl"
    two_tools = dict(TOOL, tools=TOOL["tools"] + [{"type": "function", "function": {
        "name": "get_time", "description": "Gets the time.", "parameters": {"type": "object", "properties": {}}}}])
    chats.write_text("".join(json.dumps(c) + "\n" for c in (PLAIN, TOOL, PLAIN, two_tools)))
    result = prepare(chats, "--tokenizer", tok, "--out", root / "full", "-q")
    assert result.exit_code == 0, result.output
    offsets = np.fromfile(root / "full.idx", dtype="<i8")
    mask = np.fromfile(root / "full.mask", dtype="u1")
    docs = [(int(b - a), int(np.argmax(mask[a:b] > 0))) for a, b in zip(offsets[:-1], offsets[1:])]
    return tok, chats, docs


def test_truncating_a_conversation_whose_start_holds_nothing_trained_says_so_per_row(files, tmp_path):
    tok, chats, docs = files
    (plain, _), (tool, first) = docs[0], docs[1]
    assert plain < first  # a limit between them keeps the plain conversations and cuts the tool ones before training
    limit = (plain + first) // 2
    result = prepare(chats, "--tokenizer", tok, "--out", tmp_path / "cut", "--seq-length", limit, "--truncate",
                     "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["num_dropped"] == 2 and report["num_truncated"] == 0 and report["num_documents"] == 2
    assert report["dropped"] == {NOTHING_TRAINED: {"count": 2, "rows": [
        {"row": f"{chats}:{line}", "tokens": docs[line - 1][0], "first_trained_token": docs[line - 1][1]}
        for line in (2, 4)]}}
    why = dropped_rows(chats, tok, tmp_path / "again", seq_length=limit, truncate=True)
    assert len(why) == 1 and why[0].startswith(f"2 no trained token in their first {limit} tokens"), why
    assert f"{chats}:2 (first trained token at {first} of {tool})" in why[0]
    assert f"--seq-length of at least {max(d[0] for d in docs)} keeps them whole" in why[0]


def test_without_truncate_a_longer_conversation_is_dropped_naming_its_length(files, tmp_path):
    tok, chats, docs = files
    limit = docs[0][0]
    result = prepare(chats, "--tokenizer", tok, "--out", tmp_path / "short", "--max-length", limit,
                     "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    dropped = json.loads((tmp_path / "r.json").read_text())["dropped"]
    assert list(dropped) == [TOO_LONG] and dropped[TOO_LONG]["count"] == 2
    assert [r["tokens"] for r in dropped[TOO_LONG]["rows"]] == [docs[1][0], docs[3][0]]
    why = dropped_rows(chats, tok, tmp_path / "again", max_length=limit)
    assert len(why) == 1 and f"longer than --max-length {limit}: {chats}:2 ({docs[1][0]} tokens)" in why[0], why


def test_when_nothing_is_left_the_error_names_the_reason_and_the_fix(files, tmp_path):
    tok, chats, docs = files
    only_tools = tmp_path / "tools.jsonl"
    only_tools.write_text(json.dumps(TOOL) + "\n")
    result = prepare(only_tools, "--tokenizer", tok, "--out", tmp_path / "none", "--seq-length", docs[1][1],
                     "--truncate")
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"all 1 conversations in ['{only_tools}'] were dropped: 1 no trained token in their first" in text, text
    assert "--truncate" in text and "pass --truncate" not in text  # it was passed: the fix is a longer limit
    assert not list(tmp_path.glob("none*"))


def test_text_prepare_data_on_conversations_points_at_format_harmony(files, tmp_path):
    tok, chats, _ = files
    result = run_cli("prepare-data", chats, "--tokenizer", tok, "--out", tmp_path / "t")
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and f"{chats}:1: no string field 'text' (the line is a conversation" in text, text
    assert "pass --format harmony" in text and "--text-key" not in text
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"body": "hello"}) + "\n")
    result = run_cli("prepare-data", plain, "--tokenizer", tok, "--out", tmp_path / "p")
    assert result.exit_code == 2 and "pass --text-key" in result.output and "harmony" not in result.output
