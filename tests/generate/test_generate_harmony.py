"""`gptoss generate` in the harmony format, with the real GPT-OSS tokenizer on a tiny model of its vocabulary:
the prompt equals openai-harmony's completion render, decoding stops at <|return|>/<|call|> and equals
transformers' greedy generate, and the reply's channels stream and parse as harmony parses them."""

from __future__ import annotations

import json
import shutil
from functools import partial

import pytest

from gptoss_cli.generate.decode import MAX_NEW_TOKENS, STOP_TOKEN, Generation
from tests.faults.conftest import assert_one_line
from tests.model.tiny_checkpoints import load_hf_reference, tiny_hf_model
from tests.support.cli import run_cli

h = pytest.importorskip("openai_harmony")
Role, Message, SystemContent, DeveloperContent = h.Role, h.Message, h.SystemContent, h.DeveloperContent
RETURN, CALL = 200002, 200012
VOCAB = 201088  # GPT-OSS's vocabulary: o200k_base + harmony's special tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, gpt_oss_tokenizer_file):
    """A tiny HF GPT-OSS of the real vocabulary, with the real tokenizer.json beside it."""
    folder = tmp_path_factory.mktemp("harmony") / "hf"
    tiny_hf_model(seed=0, vocab_size=VOCAB).save_pretrained(folder, safe_serialization=True)
    shutil.copy(gpt_oss_tokenizer_file, folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_hf_reference(checkpoint)


run = partial(run_cli, "generate", "--device", "cpu")


def hf_greedy_until_stop(model, prompt_ids, new):
    from tests.generate.test_generate_cli import hf_greedy

    return hf_greedy(model, prompt_ids, new, {RETURN, CALL})


def test_prompt_equals_harmonys_completion_render_and_reply_equals_transformers(checkpoint, reference, harmony, tmp_path):
    out = tmp_path / "r.json"
    result = run(checkpoint, "-p", "What is 2+2? Réponds 🤖", "--system", "You are a test model.",
                 "--developer", "Answer briefly.", "--reasoning-effort", "high", "-n", 12, "--json", out)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    (reply,) = data["replies"]
    conv = h.Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_model_identity("You are a test model.")
                                      .with_reasoning_effort(h.ReasoningEffort.HIGH)),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions("Answer briefly.")),
        Message.from_role_and_content(Role.USER, "What is 2+2? Réponds 🤖"),
    ])
    assert reply["prompt_ids"] == harmony.render_conversation_for_completion(conv, Role.ASSISTANT)
    assert data["mode"] == "harmony"
    assert sorted(data["stop_token_ids"]) == sorted(harmony.stop_tokens_for_assistant_actions()) == [RETURN, CALL]
    assert reply["output_ids"] == hf_greedy_until_stop(reference, reply["prompt_ids"], 12)


def test_a_messages_file_in_harmonys_json_renders_as_harmony_does(checkpoint, harmony, tmp_path):
    messages = [
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_conversation_start_date("2025-08-05")),
        Message.from_role_and_content(Role.USER, "hi"),
        Message.from_role_and_content(Role.ASSISTANT, "greet back").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, "Hello!").with_channel("final"),
        Message.from_role_and_content(Role.USER, "and now   <|end|> a literal\n\ttoken?"),
    ]
    conv = h.Conversation.from_messages(messages)
    file = tmp_path / "chat.json"
    file.write_text(conv.to_json())
    out = tmp_path / "r.json"
    result = run(checkpoint, "--messages", file, "-n", 2, "--json", out)
    assert result.exit_code == 0, result.output
    (reply,) = json.loads(out.read_text())["replies"]
    assert reply["prompt_ids"] == harmony.render_conversation_for_completion(conv, Role.ASSISTANT)


def _completion(harmony, final_text, analysis_text):
    """What a model writes after `<|start|>assistant`: an analysis message, then the final answer and
    <|return|>, each message rendered by openai-harmony."""
    head = harmony.render_conversation_for_completion(h.Conversation.from_messages([]), Role.ASSISTANT)
    a = harmony.render(Message.from_role_and_content(Role.ASSISTANT, analysis_text).with_channel("analysis"))
    f = harmony.render(Message.from_role_and_content(Role.ASSISTANT, final_text).with_channel("final"))
    assert a[:len(head)] == head and f[-1] == 200007  # <|end|>
    return a[len(head):] + f[:-1] + [RETURN]


@pytest.mark.parametrize("show_analysis", [False, True])
def test_the_final_channel_streams_to_stdout_and_the_analysis_only_on_request(
        checkpoint, harmony, monkeypatch, tmp_path, show_analysis):
    """The model's tokens are scripted (a random tiny model writes no harmony): what the terminal shows and
    what --json holds are the channels openai-harmony parses from the same tokens."""
    import gptoss_cli.generate.session as session

    final, analysis = "Die Antwort ist 4 ✓ — voilà.", "User asks 2+2; trivially 4. 日本語"
    script = _completion(harmony, final, analysis)

    def fake_generate(model, prompts, *, max_new_tokens, stop_ids, sampling, on_token):
        for t in script:
            on_token(0, t)
        return [Generation(list(prompts[0]), list(script), STOP_TOKEN, script[-1])]

    monkeypatch.setattr(session, "generate_ids", fake_generate)
    out = tmp_path / "r.json"
    args = ["-p", "q", "--json", out] + (["--show-analysis"] if show_analysis else [])
    result = run(checkpoint, *args)
    assert result.exit_code == 0, result.output
    assert result.stdout == final + "\n"
    assert (analysis in result.stderr) == show_analysis
    assert "stopped at <|return|>" in result.stderr
    (reply,) = json.loads(out.read_text())["replies"]
    theirs = harmony.parse_messages_from_completion_tokens(script, Role.ASSISTANT)
    assert {m.channel: m.content[0].text for m in theirs} == reply["channels"] == {"analysis": analysis, "final": final}
    assert reply["text"] == final and reply["stop_reason"] == "stop_token" and reply["stop_token"] == "<|return|>"


def test_a_reply_cut_by_the_token_limit_says_so(checkpoint, harmony, monkeypatch, tmp_path):
    import gptoss_cli.generate.session as session

    script = _completion(harmony, "four", "thinking hard about it")[:6]  # inside the analysis

    def fake_generate(model, prompts, *, max_new_tokens, stop_ids, sampling, on_token):
        for t in script:
            on_token(0, t)
        return [Generation(list(prompts[0]), list(script), MAX_NEW_TOKENS)]

    monkeypatch.setattr(session, "generate_ids", fake_generate)
    result = run(checkpoint, "-p", "q", "-n", 6)
    assert result.exit_code == 0, result.output
    assert result.stdout == "\n"
    assert "no final-channel answer (the reply holds: analysis)" in result.stderr
    assert "hit --max-new-tokens 6 before a stop token" in result.stderr


@pytest.mark.parametrize("content, needle", [
    ('{"messages": "hi"}', 'not a conversation: expected an object with a "messages" list'),
    ('[{"role": "user", "content": "hi"}]', "not a conversation"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "message 0: unknown role 'wizard'"),
    ("{not json", "not JSON"),
])
def test_a_messages_file_that_is_not_a_conversation_is_one_line_exit_2(checkpoint, tmp_path, content, needle):
    file = tmp_path / "chat.json"
    file.write_text(content)
    result = run(checkpoint, "--messages", file)
    assert_one_line((result.exit_code, result.stderr), 2, f"--messages {file}", needle)


def test_a_tokenizer_without_harmonys_tokens_points_to_raw(checkpoint, tmp_path):
    from tests.generate.test_generate_cli import write_word_tokenizer

    write_word_tokenizer(tmp_path, vocab_size=1003)
    result = run(checkpoint, "-p", "hi", "--tokenizer", tmp_path / "tokenizer.json")
    assert_one_line((result.exit_code, result.stderr), 2, "no <|start|> token", "--raw")


def test_streamed_text_is_the_decoded_text_with_multibyte_characters_split_over_tokens(gpt_oss_tokenizer_file):
    from tokenizers import Tokenizer

    from gptoss_cli.generate.session import TextStream

    tok = Tokenizer.from_file(str(gpt_oss_tokenizer_file))
    text = "Réponds 🤖 — 日本語も\n\n  line two 👩‍👩‍👧 fin.\nend ✓"
    ids = tok.encode(text, add_special_tokens=False).ids
    stream = TextStream(tok)
    pieces = [stream.push(t) for t in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces)  # some character spans tokens, held back until complete
