"""Tool data against openai-harmony: namespaces render in the order harmony sorts them (by key, its BTreeMap),
whatever order the input lists them in; and in the Hugging Face chat form a tool result that names no call goes to
the oldest call still waiting for its result."""

from __future__ import annotations

import pytest

from gptoss_cli.data.conversation import parse_conversation
from gptoss_cli.data.harmony import render_prompt
from tests.data.test_harmony import as_json, msg

h = pytest.importorskip("openai_harmony")
Role = h.Role


def test_tool_namespaces_render_sorted_as_harmony_sorts_them(harmony, harmony_tok):
    zeta = h.ToolNamespaceConfig(name="zeta", description="Z tools.", tools=[h.ToolDescription.new("f", "Does f.")])
    alpha = h.ToolNamespaceConfig(name="alpha", description=None, tools=[h.ToolDescription.new("g", "Does g.")])
    messages = [msg(Role.DEVELOPER, h.DeveloperContent.new().with_instructions("Be brief.").with_tools(zeta)
                    .with_tools(alpha)), msg(Role.USER, "Hi")]
    conv = as_json(messages)
    tools = conv["messages"][0]["content"][0]["tools"]
    assert list(tools) == ["zeta", "alpha"]  # the input lists them out of order
    want = harmony.render_conversation_for_completion(h.Conversation.from_messages(messages), Role.ASSISTANT)
    assert render_prompt(parse_conversation(conv), harmony_tok) == want


def test_a_tool_result_without_a_name_goes_to_the_oldest_pending_call():
    conv = {"messages": [
        {"role": "user", "content": "Weather in Paris and time in Oslo?"},
        {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_time", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "18 C"},  # no name, no id: the first call's
        {"role": "tool", "content": "14:02"},  # then the one still waiting
        {"role": "assistant", "content": "18 C in Paris; 14:02 in Oslo."}]}
    results = [m for m in parse_conversation(conv) if m.role == "tool"]
    assert [(m.name, m.content[0]) for m in results] == [("functions.get_weather", "18 C"),
                                                         ("functions.get_time", "14:02")]
