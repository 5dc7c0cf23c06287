"""`prepare-data --format harmony` over the dataset formats people have: the same conversations as JSONL, as
Parquet (strings of harmony's JSON, or nested chat-form columns), as a dataset saved by the `datasets` library
(save_to_disk, with splits), as a dataset id in the Hugging Face Hub cache, and in the Hugging Face chat form,
give byte-identical token files; rows that do not parse are one line naming file and row, or skipped and
counted with --errors skip."""

from __future__ import annotations

import json
from functools import partial

import pytest
from typer.testing import CliRunner

from gptoss_cli.cli import app
from gptoss_cli.data.token_format import read_token_header
from tests.data.test_harmony import CONVERSATIONS, as_json
from tests.data.test_harmony_tools import HF_SEVERAL_CALLS, TOOL_CONVERSATIONS
from tests.support.cli import run_cli

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets", reason="the test extra installs datasets (the reference writer)")

NAMES = ["several-calls-and-errors", "builtin-tools", "two-exchanges", "result-spells-special-tokens"]


prepare = partial(run_cli, "prepare-data", "--format", "harmony", "--quiet")


def token_files(prefix):
    return [prefix.with_suffix(s).read_bytes() for s in (".bin", ".idx", ".mask")]


@pytest.fixture(scope="module")
def lines():
    convs = [as_json(TOOL_CONVERSATIONS[n]) for n in NAMES] + [as_json(CONVERSATIONS["three-turns"])]
    return [json.dumps(c, ensure_ascii=False) for c in convs]


@pytest.fixture(scope="module")
def reference(lines, tmp_path_factory, gpt_oss_tokenizer_file):
    folder = tmp_path_factory.mktemp("ref")
    (folder / "chats.jsonl").write_text("\n".join(lines) + "\n")
    result = prepare(folder / "chats.jsonl", "--tokenizer", gpt_oss_tokenizer_file, "--out", folder / "ref")
    assert result.exit_code == 0, result.output
    return token_files(folder / "ref")


def test_parquet_hf_datasets_and_the_hub_cache_give_the_jsonl_token_files(lines, reference, tmp_path, monkeypatch,
                                                                         gpt_oss_tokenizer_file):
    rows = [{"id": i, "conversation": line} for i, line in enumerate(lines)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chats.parquet", row_group_size=2)
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                               "test": datasets.Dataset.from_list(rows[:1])})
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "single"))
    snapshot = tmp_path / "hub" / "datasets--acme--agent-traces" / "snapshots" / "0123abc"
    (snapshot / "data").mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abc")
    pq.write_table(pa.Table.from_pylist(rows), snapshot / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:1]), snapshot / "data" / "test-00000-of-00001.parquet")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for name, source, extra in [("parquet", tmp_path / "chats.parquet", []),
                                ("saved", tmp_path / "saved", ["--split", "train"]),
                                ("single", tmp_path / "single", []),
                                ("hub", "acme/agent-traces", [])]:  # the default split: train
        result = prepare(source, "--field", "conversation", "--tokenizer", gpt_oss_tokenizer_file,
                         "--out", tmp_path / name, *extra, "--batch-rows", "3")
        assert result.exit_code == 0, (name, result.output)
        assert token_files(tmp_path / name) == reference, name
    result = prepare(tmp_path / "saved", "--field", "conversation", "--tokenizer", gpt_oss_tokenizer_file,
                     "--out", tmp_path / "t", "--split", "validation")
    assert result.exit_code == 2 and "pass --split with one of train, test" in result.output, result.output


def _column_chat_form(conv, nested: bool):
    """The chat form as a dataset column holds it. A column has one type: tool results as strings; with `nested`
    the tools and arguments as nested structs (arrow merges the tools' schemas and the calls' arguments into
    one struct type each, null where a row lacks a field), else as strings of JSON."""
    def args(a):
        a = json.loads(a) if isinstance(a, str) else a
        return a if nested else json.dumps(a, ensure_ascii=False)

    out = {k: v for k, v in conv.items() if k != "tools"} | {"tools": conv["tools"] if nested else json.dumps(
        conv["tools"])}
    messages = []
    for m in conv["messages"]:
        m = dict(m)
        if m["role"] == "tool" and not isinstance(m["content"], str):
            c = m["content"]
            m["content"] = "".join(p["text"] for p in c) if isinstance(c, list) else json.dumps(c)
        if "tool_calls" in m:
            m["tool_calls"] = [{"id": c.get("id"), "function": {"name": (c.get("function") or c)["name"],
                                                                "arguments": args((c.get("function") or c)["arguments"])}}
                               for c in m["tool_calls"]]
        messages.append(m)
    return out | {"messages": messages}


def test_the_chat_form_in_jsonl_and_nested_parquet_gives_the_harmony_forms_token_files(tmp_path,
                                                                                      gpt_oss_tokenizer_file):
    harmony_line = json.dumps(as_json(TOOL_CONVERSATIONS["several-calls-and-errors"]), ensure_ascii=False)
    (tmp_path / "harmony.jsonl").write_text(harmony_line + "\n" + harmony_line + "\n")
    (tmp_path / "chat.jsonl").write_text(json.dumps(HF_SEVERAL_CALLS) + "\n" +
                                         json.dumps(_column_chat_form(HF_SEVERAL_CALLS, nested=False)) + "\n")
    rows = [_column_chat_form(HF_SEVERAL_CALLS, nested) for nested in (True, False)]
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "nested.parquet")
    pq.write_table(pa.Table.from_pylist(rows[1:]), tmp_path / "strings.parquet")
    for name in ("harmony", "chat"):
        result = prepare(tmp_path / f"{name}.jsonl", "--tokenizer", gpt_oss_tokenizer_file, "--out", tmp_path / name)
        assert result.exit_code == 0, result.output
    result = prepare(tmp_path / "nested.parquet", tmp_path / "strings.parquet", "--tokenizer", gpt_oss_tokenizer_file,
                     "--out", tmp_path / "pq")
    assert result.exit_code == 0, result.output
    assert token_files(tmp_path / "chat") == token_files(tmp_path / "harmony") == token_files(tmp_path / "pq")


def test_rows_that_do_not_parse_name_file_and_row_or_are_skipped_and_counted(lines, reference, tmp_path,
                                                                             gpt_oss_tokenizer_file):
    bad = ["{not json", json.dumps({"messages": [{"role": "narrator", "content": "x"}]})]
    rows = [{"conversation": line} for line in lines[:2] + bad + lines[2:]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mixed.parquet")
    (tmp_path / "mixed.jsonl").write_bytes(("\n".join(lines[:2]) + "\n").encode() + b"\xff{\n" +  # invalid UTF-8
                                           (bad[1] + "\n" + "\n".join(lines[2:]) + "\n").encode())
    result = prepare(tmp_path / "mixed.parquet", "--field", "conversation", "--tokenizer", gpt_oss_tokenizer_file,
                     "--out", tmp_path / "strict")
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert "mixed.parquet row 2: field 'conversation' is a string but not JSON" in line
    assert not list(tmp_path.glob("strict*"))
    for name, args in (("pq", [tmp_path / "mixed.parquet", "--field", "conversation"]),
                       ("jl", [tmp_path / "mixed.jsonl"])):
        result = CliRunner().invoke(app, ["prepare-data", *map(str, args), "--format", "harmony", "--tokenizer",
                                          str(gpt_oss_tokenizer_file), "--out", str(tmp_path / name), "--errors",
                                          "skip", "--json", str(tmp_path / f"{name}-report.json")])
        assert result.exit_code == 0, result.output
        assert token_files(tmp_path / name) == reference
        report = json.loads((tmp_path / f"{name}-report.json").read_text())
        assert report["num_skipped"] == 2 and read_token_header(tmp_path / name)["num_skipped"] == 2
        where = ["mixed.parquet row 2", "mixed.parquet row 3"] if name == "pq" else ["mixed.jsonl:3", "mixed.jsonl:4"]
        assert [s.split(": ")[0].rsplit("/", 1)[-1] for s in report["skipped"]] == where
        assert "unknown role 'narrator'" in report["skipped"][1]
        assert "skipped" in result.output and where[1] in result.output.replace("\n", "")
