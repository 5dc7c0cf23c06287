"""Training data: the mock source, token files from `gptoss prepare-data`, sharding by DP rank."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from gptoss_cli.cli import app
from gptoss_cli.errors import ConfigError
from gptoss_cli.model.config import preset
from gptoss_cli.train.data import DataLoaderState, MockSource, TokenFileSource, read_token_header
from gptoss_cli.train.loop import TrainPlan, run_worker

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
    plan = TrainPlan(name="mock", arch=arch, hybrid_layer_pattern=arch.hybrid_layer_pattern, run_dir=str(tmp_path),
                     seq_length=16, micro_batch_size=4, global_batch_size=4, train_iters=15, lr=3e-3, min_lr=3e-3,
                     warmup_iters=0, device="cpu")
    losses = run_worker(plan).losses
    assert losses[-1] < losses[0] - 1.0  # from ~ln(1003) = 6.9 down by more than one nat


def test_training_reads_the_prepared_token_file(prepared, tmp_path):
    arch = preset("tiny")
    plan = TrainPlan(name="tok", arch=arch, hybrid_layer_pattern=arch.hybrid_layer_pattern, run_dir=str(tmp_path),
                     seq_length=8, micro_batch_size=2, global_batch_size=2, train_iters=2, device="cpu",
                     data_kind="tokens", data_path=str(prepared))
    result = run_worker(plan)
    assert len(result.losses) == 2 and all(l == l for l in result.losses)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["step"] for l in lines] == [1, 2]
