"""`gptoss generate` in agent loops: a conversation that ends with tool results (harmony's JSON or the Hugging
Face chat form) is continued from openai-harmony's completion render, and a reply that is a tool call lands
in --json with its recipient, constraint and arguments as openai-harmony parses them."""

from __future__ import annotations

import json
from functools import partial

import pytest

from gptoss_cli.generate.decode import STOP_TOKEN, Generation
from tests.data.test_harmony import as_json
from tests.data.test_harmony_tools import HF_SEVERAL_CALLS, TOOL_CONVERSATIONS, call
from tests.generate.test_generate_harmony import checkpoint  # noqa: F401  (a fixture)
from tests.support.cli import run_cli

h = pytest.importorskip("openai_harmony")
Role = h.Role
CALL = 200012


run = partial(run_cli, "generate", "--device", "cpu")


def _scripted(monkeypatch, script):
    import gptoss_cli.generate.session as session

    def fake_generate(model, prompts, *, max_new_tokens, stop_ids, sampling, on_token):
        for t in script:
            on_token(0, t)
        return [Generation(list(prompts[0]), list(script), STOP_TOKEN, script[-1])]

    monkeypatch.setattr(session, "generate_ids", fake_generate)


def test_a_conversation_ending_with_tool_results_continues_from_harmonys_prompt(checkpoint, harmony, monkeypatch,
                                                                              tmp_path):
    """The chat form (tools, tool_calls, role tool) and harmony's JSON give harmony's completion render."""
    messages = TOOL_CONVERSATIONS["several-calls-and-errors"][:9]  # through the two results
    hf = {**HF_SEVERAL_CALLS, "messages": HF_SEVERAL_CALLS["messages"][:4]}
    want = harmony.render_conversation_for_completion(h.Conversation.from_messages(messages), Role.ASSISTANT)
    head = harmony.render_conversation_for_completion(h.Conversation.from_messages([]), Role.ASSISTANT)
    answer = harmony.render(h.Message.from_role_and_content(Role.ASSISTANT, "Oslo timed out.").with_channel("final"))
    _scripted(monkeypatch, answer[len(head):-1] + [200002])
    for name, conv in (("harmony", as_json(messages)), ("chat", hf)):
        (tmp_path / f"{name}.json").write_text(json.dumps(conv))
        result = run(checkpoint, "--messages", tmp_path / f"{name}.json", "--json", tmp_path / f"{name}-r.json")
        assert result.exit_code == 0, result.output
        (reply,) = json.loads((tmp_path / f"{name}-r.json").read_text())["replies"]
        assert reply["prompt_ids"] == want, name
        assert reply["text"] == "Oslo timed out." and reply["tool_calls"] == []


def test_a_tool_call_reply_holds_recipient_constraint_and_arguments(checkpoint, harmony, monkeypatch, tmp_path):
    conv = TOOL_CONVERSATIONS["function-call"][:3]
    head = harmony.render_conversation_for_completion(h.Conversation.from_messages([]), Role.ASSISTANT)
    think = harmony.render(h.Message.from_role_and_content(Role.ASSISTANT, "Need the tool.").with_channel("analysis"))
    args = '{"location": "東京, Japan", "days": 2}'
    tool_call = harmony.render(call("functions.get_weather", args))
    script = think[len(head):] + tool_call  # the call's own <|start|>assistant is the model's to write
    assert script[-1] == CALL
    _scripted(monkeypatch, script)
    (tmp_path / "c.json").write_text(json.dumps(as_json(conv)))
    result = run(checkpoint, "--messages", tmp_path / "c.json", "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert "a call to functions.get_weather" in result.stderr and "stopped at <|call|>" in result.stderr
    (reply,) = json.loads((tmp_path / "r.json").read_text())["replies"]
    (theirs,) = [m for m in harmony.parse_messages_from_completion_tokens(script, Role.ASSISTANT) if m.recipient]
    (got,) = reply["tool_calls"]
    assert (got["recipient"], got["channel"], got["content_type"], got["arguments_text"]) == \
        (theirs.recipient, theirs.channel, theirs.content_type, theirs.content[0].text)
    assert got["constraint"] == "json" and got["arguments"] == {"location": "東京, Japan", "days": 2}
    assert (got["namespace"], got["name"]) == ("functions", "get_weather")
