"""Training data: the mock source, token files from `gptoss prepare-data`, sharding by DP rank."""

from __future__ import annotations

import dataclasses
import json
import math
from functools import partial

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from gptoss_cli.cli import app
from gptoss_cli.errors import ConfigError
from gptoss_cli.model.config import preset
from gptoss_cli.data.token_format import read_token_header
from gptoss_cli.train.data import DataLoaderState, MockSource, TokenFileSource
from gptoss_cli.run.worker import run_worker
from gptoss_cli.train.objective import CrossEntropyObjective
from tests.support.cli import run_cli
from tests.train.jobs import train_job

DOCS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine",
    "all that glitters is not gold, said the fox",
    "the early bird catches the worm; the dog sleeps",
] * 3


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A small BPE tokenizer trained here (no download), saved as tokenizer.json with an EOS token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer)
    tok.decoder = __import__("tokenizers").decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def prepared(tokenizer_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("data")
    jsonl = work / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:6]))
    txt = work / "more.txt"
    txt.write_text("\n\n".join(DOCS[6:]) + "\n")
    result = CliRunner().invoke(app, ["prepare-data", str(jsonl), str(txt), "--tokenizer", str(tokenizer_dir),
                                      "--out", str(work / "corpus"), "--quiet"])
    assert result.exit_code == 0, result.output
    return work / "corpus"


def test_prepare_data_writes_documents_separated_by_eos(prepared, tokenizer_dir):
    from tokenizers import Tokenizer

    header = read_token_header(prepared)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    assert header["dtype"] == "uint16" and header["eos_token_id"] == eos and header["num_documents"] == len(DOCS)
    raw = prepared.with_suffix(".bin").read_bytes()
    ids = torch.frombuffer(bytearray(raw), dtype=torch.uint16).to(torch.int64).tolist()
    assert len(ids) == header["num_tokens"]
    docs, cur = [], []
    for i in ids:
        if i == eos:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    assert docs == DOCS and not cur


def test_token_file_windows_are_inputs_and_shifted_labels(prepared):
    source = TokenFileSource(prepared, seq_length=8, seed=0)
    tokens = source.tokens.to(torch.int64)
    assert source.num_samples == (len(tokens) - 1) // 8
    seen = set()
    for i in range(source.num_samples):
        w = source.sample(i)
        assert w.shape == (9,)
        starts = [j for j in range(source.num_samples) if torch.equal(tokens[j * 8 : j * 8 + 9], w)]
        seen.update(starts)
    assert seen == set(range(source.num_samples))  # an epoch is a permutation of all windows


def test_token_file_shorter_than_one_sample_is_a_config_error(prepared):
    with pytest.raises(ConfigError, match="fewer than one sample"):
        TokenFileSource(prepared, seq_length=100_000, seed=0)


def test_dp_ranks_split_the_global_batch_like_accumulation():
    source = MockSource(1003, 8, seed=1)
    one = DataLoaderState(source, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1)
    ranks = [DataLoaderState(source, global_batch_size=8, micro_batch_size=2, dp_rank=r, dp_size=2) for r in (0, 1)]
    for _ in range(2):
        whole = torch.cat([mb.tokens for mb in one.step_iterator()])
        split = torch.cat([mb.tokens for r in ranks for mb in r.step_iterator()])
        assert torch.equal(whole, split)
    assert one.state_dict() == {"consumed_samples": 16} == ranks[1].state_dict()


def test_mock_source_is_deterministic_and_learnable(tmp_path):
    a, b = MockSource(1003, 16, seed=5), MockSource(1003, 16, seed=5)
    assert torch.equal(a.sample(7), b.sample(7)) and not torch.equal(a.sample(7), a.sample(8))
    arch = preset("tiny")
    plan = train_job(tmp_path, arch=arch, name="mock", seq_length=16, micro_batch_size=4, global_batch_size=4,
                     train_iters=15, lr=3e-3, min_lr=3e-3, warmup_iters=0, device="cpu")
    losses = run_worker(plan).losses
    assert losses[-1] < losses[0] - 1.0  # from ~ln(1003) = 6.9 down by more than one nat


def file_windows(prefix, seq: int, dtype: str = "<u2") -> list[list[int]]:
    """Every window [i*S, i*S+S+1) of the .bin file, read with numpy (not the loader)."""
    ids = np.fromfile(prefix.with_suffix(".bin"), dtype=dtype).tolist()
    return [ids[i * seq : i * seq + seq + 1] for i in range((len(ids) - 1) // seq)]


def test_training_trains_on_the_token_files_windows(prepared, tmp_path):
    """One step whose global batch is the whole file: the microbatches the model sees are exactly
    the file's windows, each once (inputs = the first S tokens, labels = the next S)."""
    seen = []

    class Recording(CrossEntropyObjective):
        def prepare_step(self, microbatches, context):
            for mb in microbatches:
                seen.extend(torch.cat([mb.tokens, mb.labels[:, -1:]], dim=1).tolist())
                assert torch.equal(mb.labels[:, :-1], mb.tokens[:, 1:])
                yield mb

    windows = file_windows(prepared, 8)
    arch = preset("tiny")
    plan = train_job(tmp_path, arch=arch, name="tok", seq_length=8, micro_batch_size=1, global_batch_size=len(windows),
                     train_iters=1, device="cpu", data_kind="tokens", data_path=str(prepared))
    result = run_worker(dataclasses.replace(plan, objective=Recording()))
    assert sorted(seen) == sorted(windows) and len(windows) > 8
    assert len(result.losses) == 1 and math.isfinite(result.losses[0])
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line)["rank_tokens"] == 8 * len(windows)


# --- prepare-data through the CLI: dtypes, the 65536 boundary, --eos-id, --text-key ---------------
def word_tokenizer(folder, size: int):
    """A word-level tokenizer.json whose word `w{i}` is id i, for i < size (ids chosen by the test)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


prepare = partial(run_cli, "prepare-data", "--quiet")


@pytest.mark.parametrize(
    "size, eos, dtype, numpy_dtype",
    [(65536, 65535, "uint16", "<u2"), (65537, 65536, "uint32", "<u4")],
    ids=["65536-ids-fit-uint16", "65537-ids-need-uint32"],
)
def test_token_width_follows_the_vocabulary_and_keeps_the_largest_ids(size, eos, dtype, numpy_dtype, tmp_path):
    tok = word_tokenizer(tmp_path / "tok", size)
    text = tmp_path / "docs.txt"
    text.write_text(f"w0 w{size - 1} w40000\n\nw7 w{size - 2}\n")
    result = prepare(text, "--tokenizer", tok, "--out", tmp_path / "out", "--eos-id", eos)
    assert result.exit_code == 0, result.output
    header = json.loads((tmp_path / "out.json").read_text())
    assert (header["dtype"], header["vocab_size"], header["eos_token_id"]) == (dtype, size, eos)
    ids = np.fromfile(tmp_path / "out.bin", dtype=numpy_dtype).tolist()
    assert ids == [0, size - 1, 40000, eos, 7, size - 2, eos]
    # the training loader reads the same ids back at this width
    assert TokenFileSource(tmp_path / "out", seq_length=6, seed=0).tokens.to(torch.int64).tolist() == ids


def test_eos_id_option_overrides_the_checkpoints_eos_token_id(tmp_path):
    tok = word_tokenizer(tmp_path / "tok", 50)
    (tok / "config.json").write_text(json.dumps({"eos_token_id": 49}))
    text = tmp_path / "docs.txt"
    text.write_text("w1 w2\n\nw3\n")
    assert prepare(text, "--tokenizer", tok, "--out", tmp_path / "a").exit_code == 0
    assert np.fromfile(tmp_path / "a.bin", dtype="<u2").tolist() == [1, 2, 49, 3, 49]
    assert prepare(text, "--tokenizer", tok, "--out", tmp_path / "b", "--eos-id", "48").exit_code == 0
    assert np.fromfile(tmp_path / "b.bin", dtype="<u2").tolist() == [1, 2, 48, 3, 48]
    assert json.loads((tmp_path / "b.json").read_text())["eos_token_id"] == 48


def test_text_key_selects_the_jsonl_field(tmp_path):
    tok = word_tokenizer(tmp_path / "tok", 50)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": "w9 w9", "body": b}) + "\n" for b in ("w1 w2", "w3")))
    result = prepare(jsonl, "--tokenizer", tok, "--out", tmp_path / "out", "--eos-id", "49", "--text-key", "body")
    assert result.exit_code == 0, result.output
    assert np.fromfile(tmp_path / "out.bin", dtype="<u2").tolist() == [1, 2, 49, 3, 49]


@pytest.mark.parametrize(
    "second_line, message",
    [
        (json.dumps({"text": "w1"}), "docs.jsonl:2: no string field 'body'"),
        (json.dumps({"body": 5}), "docs.jsonl:2: no string field 'body'"),
        (json.dumps(["body", "w1"]), "docs.jsonl:2: no string field 'body'"),
        ("{not json", "docs.jsonl:2: not a JSON object"),
    ],
    ids=["key-missing", "not-a-string", "not-an-object", "not-json"],
)
def test_text_key_errors_name_the_file_line_and_key_and_write_nothing(second_line, message, tmp_path):
    tok = word_tokenizer(tmp_path / "tok", 50)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"body": "w1"}) + "\n" + second_line + "\n")
    result = prepare(jsonl, "--tokenizer", tok, "--out", tmp_path / "out", "--eos-id", "49", "--text-key", "body")
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert message in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "tok"]


def test_token_header_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    from gptoss_cli.data import token_format

    json_path = tmp_path / "t.json"
    fields = dict(dtype="uint16", num_tokens=9, num_documents=2, vocab_size=50, eos_token_id=49, tokenizer=None,
                  sources=["a.txt"])
    token_format.write_token_header(json_path, **fields)
    before = json_path.read_text()
    assert read_token_header(json_path) == {"format": "gptoss-tokens", "version": 1, **fields}

    def killed_before_the_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(token_format.outputs.os, "replace", killed_before_the_rename)
    with pytest.raises(OSError):
        token_format.write_token_header(json_path, **{**fields, "num_tokens": 10})
    assert json_path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["t.json"]
