"""Conversations end to end: `prepare-data --format harmony` (the real GPT-OSS tokenizer, built offline),
`train` on the version-2 file, `eval` of the run's checkpoint.

The tiny model gets the real vocabulary (201,088) so the harmony token ids fit. What this proves: the
three commands agree on the shared format, in particular that eval (and so training's loader) turns
the mask into exactly the header's `num_loss_tokens` labels, one per trained token.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from gptoss_cli.cli import app
from gptoss_cli.data.token_format import read_token_header
from gptoss_cli.run.worker import run_worker
from tests.train.jobs import TINY, train_job

pytest.importorskip("openai_harmony", reason="the test extra installs openai-harmony")
pytest.importorskip("bpe_openai", reason="the test extra installs bpe-openai")


def test_prepare_train_eval_on_harmony_conversations(tmp_path):
    from tests.data.harmony_tokenizer import cache_folder, gpt_oss_tokenizer_json
    from tests.data.test_harmony import CONVERSATIONS, as_json

    tokenizer = gpt_oss_tokenizer_json(cache_folder())
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(as_json(m)) + "\n" for m in CONVERSATIONS.values()))
    prefix = tmp_path / "sft"
    runner = CliRunner()
    result = runner.invoke(app, ["prepare-data", str(chats), "--format", "harmony", "--tokenizer", str(tokenizer),
                                 "--out", str(prefix), "--quiet"])
    assert result.exit_code == 0, result.output
    header = read_token_header(prefix)
    seq = header["max_document_length"]

    arch = dataclasses.replace(TINY, vocab_size=201_088)
    job = train_job(tmp_path / "run", arch=arch, data_kind="tokens", data_path=str(prefix), seq_length=seq,
                    global_batch_size=2, micro_batch_size=1, train_iters=2, lr=1e-3, checkpoint_dir=str(tmp_path / "ckpt"))
    trained = run_worker(job)
    assert trained.packing["seq_length"] == seq and 0 < trained.packing["efficiency"] <= 1

    result = runner.invoke(app, ["eval", str(tmp_path / "ckpt"), "--data", str(prefix), "--seq-length", str(seq),
                                 "--json", str(tmp_path / "e.json"), "--quiet"])
    assert result.exit_code == 0, result.output
    got = json.loads((tmp_path / "e.json").read_text())
    assert got["loss_tokens"] == header["num_loss_tokens"]
    assert len(got["documents"]) == header["num_documents"]
    assert got["tokens"] == header["num_tokens"]
