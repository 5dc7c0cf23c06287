"""`gptoss prepare-data --format harmony`: version-2 files whose documents and masks are openai-harmony's rendering,
length limits that drop and count (or truncate), the packing report, and one-line errors that write nothing."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest

from gptoss_cli.data.packing import pack_documents, packing_efficiency
from gptoss_cli.data.token_format import check_token_files, read_token_header
from tests.data.test_harmony import CONVERSATIONS, RETURN, as_json
from tests.support.cli import run_cli

h = pytest.importorskip("openai_harmony")

HF_LINE = {"reasoning_effort": "low", "messages": [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋   there"},
    {"role": "assistant", "thinking": "A greeting.", "content": "Hello!"}]}


prepare = partial(run_cli, "prepare-data", "--quiet")


def read_documents(prefix):
    tokens = np.fromfile(prefix.with_suffix(".bin"), dtype="<u4")
    offsets = np.fromfile(prefix.with_suffix(".idx"), dtype="<i8")
    mask = np.fromfile(prefix.with_suffix(".mask"), dtype="u1")
    return [(tokens[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]


@pytest.fixture
def corpus(tmp_path):
    lines = [json.dumps(as_json(CONVERSATIONS[name])) for name in ("one-turn", "three-turns", "unicode-code-emoji")]
    path = tmp_path / "chats.jsonl"
    path.write_text(lines[0] + "\n\n" + lines[1] + "\n" + json.dumps(HF_LINE, ensure_ascii=False) + "\n" + lines[2] + "\n")
    return path


def test_documents_are_harmonys_training_render_with_the_mask_on_the_answer(corpus, tmp_path, harmony,
                                                                            gpt_oss_tokenizer_file):
    result = prepare(corpus, "--format", "harmony", "--tokenizer", gpt_oss_tokenizer_file, "--out", tmp_path / "sft",
                     "--analysis", "drop", "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    docs = read_documents(tmp_path / "sft")
    drop = h.RenderConversationConfig(auto_drop_analysis=True)
    one_turn = harmony.render_conversation_for_training(h.Conversation.from_messages(CONVERSATIONS["one-turn"]), drop)
    assert docs[0][0] == one_turn
    # --analysis drop trains only the final answer: "<|channel|>final<|message|>4<|return|>"
    assert harmony.decode([t for t, m in zip(*docs[0]) if m]) == "<|channel|>final<|message|>4<|return|>"
    assert len(docs) == 4 and all(m[0] == 0 and t[-1] == RETURN and m[-1] == 1 for t, m in docs)
    header = read_token_header(tmp_path / "sft")
    assert header["version"] == 2 and header["kind"] == "harmony" and header["eos_token_id"] is None
    assert header["num_loss_tokens"] == sum(sum(m) for _, m in docs)
    assert header["max_document_length"] == max(len(t) for t, _ in docs) and header["num_dropped"] == 0
    assert header["rendering"] == {"analysis": "drop", "train_on": "last", "max_length": None, "truncate": False}
    check_token_files(tmp_path / "sft", 201088)
    assert json.loads((tmp_path / "r.json").read_text())["num_documents"] == 4


def test_long_conversations_are_dropped_and_counted_or_truncated(corpus, tmp_path, gpt_oss_tokenizer_file):
    assert prepare(corpus, "--format", "harmony", "--tokenizer", gpt_oss_tokenizer_file, "--out", tmp_path / "all"
                   ).exit_code == 0
    lengths = [len(t) for t, _ in read_documents(tmp_path / "all")]
    limit = sorted(lengths)[1]  # two conversations are longer
    result = prepare(corpus, "--format", "harmony", "--tokenizer", gpt_oss_tokenizer_file, "--out", tmp_path / "cut",
                     "--max-length", limit)
    assert result.exit_code == 0, result.output
    header = read_token_header(tmp_path / "cut")
    assert header["num_dropped"] == 2 and header["num_documents"] == 2
    assert [len(t) for t, _ in read_documents(tmp_path / "cut")] == [n for n in lengths if n <= limit]
    # --train-on all trains the early turns too, so some trained tokens survive the cut
    for out, extra in (("full", []), ("tr", ["--max-length", limit, "--truncate", "--json", tmp_path / "tr.json"])):
        result = prepare(corpus, "--format", "harmony", "--tokenizer", gpt_oss_tokenizer_file, "--out", tmp_path / out,
                         "--train-on", "all", *extra)
        assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "tr.json").read_text())
    full = read_documents(tmp_path / "full")
    cut = read_documents(tmp_path / "tr")
    # a cut conversation keeps its first `limit` tokens when any trained token survives, else it is dropped
    kept = [(t[:limit], m[:limit]) for t, m in full if any(m[:limit])]
    assert cut == kept
    assert report["num_truncated"] >= 1 and report["num_truncated"] + report["num_dropped"] == 2
    assert report["num_documents"] == len(kept) == 4 - report["num_dropped"]


def test_the_packing_report_is_best_fit_over_the_documents(corpus, tmp_path, gpt_oss_tokenizer_file):
    result = prepare(corpus, "--format", "harmony", "--tokenizer", gpt_oss_tokenizer_file, "--out", tmp_path / "p",
                     "--seq-length", 512)
    assert result.exit_code == 0, result.output
    lengths = [len(t) for t, _ in read_documents(tmp_path / "p")]
    rows = pack_documents(lengths, 512)
    assert read_token_header(tmp_path / "p")["packing"] == {
        "seq_length": 512, "rows": len(rows), "efficiency": round(packing_efficiency(lengths, rows, 512), 6)}
    assert read_token_header(tmp_path / "p")["rendering"]["max_length"] == 512


@pytest.mark.parametrize("line, message", [
    ("{not json", "chats.jsonl:2: not JSON"),
    (json.dumps({"text": "plain"}), "chats.jsonl:2: not a conversation"),
    (json.dumps({"messages": [{"role": "narrator", "content": "x"}]}), "chats.jsonl:2: message 0: unknown role 'narrator'"),
    (json.dumps({"messages": [{"role": "user", "content": "x"},
                              {"role": "assistant", "content": "y", "channel": "thoughts"}]}),
     "chats.jsonl:2: message 1: unknown channel 'thoughts'"),
    (json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
     "chats.jsonl:2: the conversation has no assistant turn"),
], ids=["not-json", "not-a-conversation", "unknown-role", "unknown-channel", "no-assistant-turn"])
def test_bad_lines_name_file_and_line_exit_2_and_write_nothing(line, message, tmp_path, gpt_oss_tokenizer_file):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(HF_LINE) + "\n" + line + "\n")
    result = prepare(path, "--format", "harmony", "--tokenizer", gpt_oss_tokenizer_file, "--out", tmp_path / "o")
    assert result.exit_code == 2
    (out,) = result.output.strip().splitlines()
    assert message in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]


def test_a_tokenizer_without_harmony_tokens_is_one_line_and_writes_nothing(tmp_path):
    from tokenizers import Tokenizer, models

    tok = tmp_path / "tok"
    tok.mkdir()
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tok / "tokenizer.json"))
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(HF_LINE) + "\n")
    result = prepare(path, "--format", "harmony", "--tokenizer", tok, "--out", tmp_path / "o")
    assert result.exit_code == 2
    (out,) = result.output.strip().splitlines()
    assert "tokenizer.json: no <|start|> token" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl", "tok"]


@pytest.mark.parametrize("args, message", [
    (["--analysis", "drop"], "--analysis does not apply to --format text"),
    (["--format", "harmony", "--text-key", "body"], "--text-key does not apply to --format harmony"),
    (["--format", "harmony", "--analysis", "maybe"], "--analysis 'maybe' is not one of keep, drop"),
    (["--format", "harmony", "--train-on", "first"], "--train-on 'first' is not one of last, all"),
    (["--format", "harmony", "--truncate"], "--truncate needs --max-length"),
    (["--format", "harmony", "--max-length", "1"], "--max-length 1 must be at least 2"),
    (["--format", "harmony", "--max-length", "600", "--seq-length", "512"], "longer than --seq-length 512"),
    (["--format", "yaml"], "--format 'yaml' is not one of text, harmony"),
])
def test_option_mistakes_are_one_line(args, message, tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(HF_LINE) + "\n")
    result = prepare(path, "--tokenizer", tmp_path, "--out", tmp_path / "o", *args)
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize("part", [".idx", ".json"])
def test_a_full_disk_at_the_index_or_header_leaves_the_older_set_whole(part, corpus, tmp_path, gpt_oss_tokenizer_file,
                                                                        monkeypatch):
    """Rewriting a prefix: every part is written under a temporary name before any is renamed, so a disk that fills
    at the last parts leaves the previous set byte for byte (not its .bin and .mask replaced under an old header)."""
    import errno
    from pathlib import Path

    out = tmp_path / "set"
    assert prepare(corpus, "--format", "harmony", "--tokenizer", gpt_oss_tokenizer_file, "--out", out).exit_code == 0
    before = {s: out.with_suffix(s).read_bytes() for s in (".bin", ".idx", ".mask", ".json")}
    corpus.write_text(json.dumps(HF_LINE) + "\n")  # another corpus: every part would change
    write_bytes = Path.write_bytes

    def full_at_part(self, data):
        if self.name.startswith(f".set{part}."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_bytes(self, data)

    monkeypatch.setattr(Path, "write_bytes", full_at_part)
    result = prepare(corpus, "--format", "harmony", "--tokenizer", gpt_oss_tokenizer_file, "--out", out)
    assert result.exit_code != 0 and "No space left on device" in result.output, result.output
    assert {s: out.with_suffix(s).read_bytes() for s in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl", *sorted(f"set{s}" for s in before)]
