"""Tokens: ids outside the vocabulary, invalid UTF-8 and binary input are errors naming the file."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gptoss_cli.cli import app
from tests.faults.conftest import TRAIN_FAST, assert_one_line, gptoss, leftovers
from tests.support.cli import exit_and_output

pytest.importorskip("tokenizers")
runner = CliRunner()


def write_tokenizer(folder: Path) -> Path:
    """A 300-token byte-level BPE tokenizer trained here (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


prepare = partial(exit_and_output, "prepare-data", "--quiet")


def test_an_eos_id_outside_the_tokenizer_is_refused(tok, tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n")
    proc = gptoss("prepare-data", tmp_path / "a.txt", "--tokenizer", tok, "--out", tmp_path / "o", "--eos-id", "70000",
                  cwd=tmp_path)
    vocab = json.loads((tok / "tokenizer.json").read_text())
    assert_one_line(proc, 2, "--eos-id 70000 is outside the vocabulary", str(tok / "tokenizer.json"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"] and vocab


def test_invalid_utf8_names_the_file_and_byte_offset_unless_replacement_is_asked_for(tok, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"first document\n\nsecond \xff document\n")
    code, out = prepare(bad, "--tokenizer", tok, "--out", tmp_path / "o")
    assert code == 2 and f"{bad}: invalid UTF-8 at byte offset 23" in out, out
    assert not (tmp_path / "o.bin").exists() and leftovers(tmp_path) == []
    code, out = prepare(bad, "--tokenizer", tok, "--out", tmp_path / "o", "--errors", "replace")
    assert code == 0, out


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_binary_input_is_refused(tok, tmp_path, suffix):
    blob = tmp_path / f"blob{suffix}"
    first = b'{"text": "a document"}\n' if suffix == ".jsonl" else b"looks like text at first\n"
    blob.write_bytes(first + b"\x7fELF\x02\x01\x01\x00" + os.urandom(256))
    code, out = prepare(blob, "--tokenizer", tok, "--out", tmp_path / "o", "--errors", "replace")
    assert code == 2 and f"{blob}: NUL byte at byte offset {len(first) + 7}" in out and "binary" in out, out


def train_on_token_file(tmp_path, ids: list[int], dtype: str = "uint16", width: int = 2):
    """Train 20 steps on a token file holding `ids` whose header claims a 300-token vocabulary."""
    (tmp_path / "t.bin").write_bytes(b"".join(i.to_bytes(width, "little", signed=dtype.startswith("int"))
                                              for i in ids))
    (tmp_path / "t.json").write_text(json.dumps({"format": "gptoss-tokens", "version": 1, "dtype": dtype,
                                                 "num_tokens": len(ids), "num_documents": 1, "vocab_size": 300,
                                                 "eos_token_id": 1}))
    result = runner.invoke(app, ["train", "--recipe", "tiny_cpu_ep2", "--nproc-per-node", "1",
                                 "parallelism.expert_model_parallel_size=1", "data.kind=tokens",
                                 f"data.path={tmp_path / 't'}", "checkpoint.dir=null", "checkpoint.save_interval=null",
                                 f"logging.run_dir={tmp_path / 'run'}", "training.train_iters=20", *TRAIN_FAST, "-q"])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def test_a_token_file_with_ids_past_the_model_vocabulary_names_the_file(tmp_path):
    # The header claims a small vocabulary, the tokens say otherwise (a foreign or edited file).
    result = train_on_token_file(tmp_path, [5, 7, 9] * 40 + [5000] + [5, 7] * 20)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert (f"{tmp_path / 't.bin'}: token id 5000 at token 120 is outside the model's vocabulary (1003)"
            in " ".join(result.output.split())), result.output


@pytest.mark.parametrize("dtype, width", [("int32", 4), ("int64", 8)])
def test_a_negative_token_id_in_a_signed_token_file_names_the_file(tmp_path, dtype, width):
    result = train_on_token_file(tmp_path, [5, 7, 9] * 40 + [-3] + [5, 7] * 20, dtype, width)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert (f"{tmp_path / 't.bin'}: token id -3 at token 120 is outside the model's vocabulary (1003)"
            in " ".join(result.output.split())), result.output
