"""`gptoss eval` against transformers' GptOssForCausalLM scoring each conversation (document) alone.

Reference: transformers' forward of each document by itself (eager attention, fp32), its labels the
next tokens where the file's mask is 1 (computed here from the mask, not by our loader), summed
cross-entropy. Tolerance: the fp32 logits of the two implementations agree to 1e-5
(tests/model/test_hybrid_vs_transformers.py), so sums of cross-entropies agree to a relative 1e-5.
"""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gptoss_cli.data.token_format import token_file_paths, write_atomically, write_token_header
from tests.model.tiny_checkpoints import load_hf_reference, write_converted_pair
from tests.support.cli import run_cli
from tests.train.sft_files import sft_documents, write_sft_file

VOCAB = 1003  # tests/model/conftest.py's tiny transformers config
LENGTHS = [6, 29, 11, 2, 17, 23, 9]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_converted_pair(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def reference(checkpoints):
    return load_hf_reference(checkpoints[0])


_eval = partial(run_cli, "eval")


def _doc_loss(hf, doc: torch.Tensor, mask: torch.Tensor | None) -> tuple[float, int]:
    with torch.no_grad():
        logits = hf(input_ids=doc[None]).logits[0, :-1]
    targets = doc[1:].clone()
    if mask is not None:
        targets[mask[1:] == 0] = -100
    return float(F.cross_entropy(logits.double(), targets, ignore_index=-100, reduction="sum")), int((targets != -100).sum())


@pytest.mark.parametrize("which", [0, 1], ids=["hf", "hybrid"])
def test_eval_of_a_v2_file_equals_transformers_on_each_document_alone(checkpoints, reference, tmp_path, which):
    docs, masks = sft_documents(LENGTHS, VOCAB, seed=5)
    prefix = write_sft_file(tmp_path / "val", docs, masks, VOCAB)
    result = _eval(checkpoints[which], "--data", prefix, "--seq-length", 32, "--micro-batch-size", 2,
                   "--json", tmp_path / "e.json", "--quiet")
    assert result.exit_code == 0, result.output
    got = json.loads((tmp_path / "e.json").read_text())
    want = [_doc_loss(reference, d, m) for d, m in zip(docs, masks)]
    assert [d["index"] for d in got["documents"]] == list(range(len(docs)))
    for entry, (s, c), doc in zip(got["documents"], want, docs):
        assert (entry["loss_tokens"], entry["tokens"]) == (c, len(doc))
        assert entry["loss_sum"] == pytest.approx(s, rel=1e-5)
    total, count = sum(s for s, _ in want), sum(c for _, c in want)
    assert got["loss_tokens"] == count
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)
    assert got["perplexity"] == pytest.approx(np.exp(total / count), rel=1e-5)
    assert got["packing_efficiency"] == pytest.approx(sum(LENGTHS) / (got["rows"] * 32))


def test_eval_of_a_v1_file_counts_every_next_token_of_trainings_windows(checkpoints, reference, tmp_path):
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (53,), generator=g)
    bin_path, json_path = token_file_paths(tmp_path / "plain")
    write_atomically(bin_path, tokens.numpy().astype(np.uint16))
    write_token_header(json_path, dtype="uint16", num_tokens=53, num_documents=1, vocab_size=VOCAB, eos_token_id=None,
                       tokenizer=None, sources=["test"])
    result = _eval(checkpoints[0], "--data", tmp_path / "plain", "--seq-length", 16, "--json", tmp_path / "e.json")
    assert result.exit_code == 0, result.output
    assert "loss" in result.output and "3 windows of 16 tokens" in result.output
    got = json.loads((tmp_path / "e.json").read_text())
    want = [_doc_loss(reference, tokens[j * 16:j * 16 + 17], None) for j in range(3)]  # (53 - 1) // 16 windows
    assert got["loss_tokens"] == 48 and got["documents"] is None
    assert got["loss"] == pytest.approx(sum(s for s, _ in want) / 48, rel=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--seq-length", "16"], "val.idx: document 1 has 29 tokens, more than a row of 16 holds"),
    (["--dtype", "float16"], "--dtype 'float16' is not supported"),
])
def test_bad_options_are_one_line_exit_2(checkpoints, tmp_path, args, message):
    docs, masks = sft_documents(LENGTHS, VOCAB, seed=5)
    prefix = write_sft_file(tmp_path / "val", docs, masks, VOCAB)
    result = _eval(checkpoints[0], "--data", prefix, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_bad_files_are_one_line_exit_2(checkpoints, tmp_path):
    result = _eval(checkpoints[0], "--data", tmp_path / "missing")
    assert result.exit_code == 2 and "missing.json not found" in result.output
    docs, masks = sft_documents(LENGTHS, VOCAB, seed=5)
    prefix = write_sft_file(tmp_path / "val", docs, masks, VOCAB)
    prefix.with_suffix(".mask").unlink()
    result = _eval(checkpoints[0], "--data", prefix)
    assert result.exit_code == 2 and "val.mask not found" in result.output, result.output
    result = _eval(tmp_path, "--data", prefix)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output


def eval_worker(rank: int, checkpoint: str, prefix: str, ep: int) -> dict:
    from gptoss_cli.train.evaluate import evaluate

    return evaluate(checkpoint, prefix, seq_length=40, device="cpu", expert_parallel=ep).to_json()  # 3 rows


@pytest.mark.parametrize("ep", [1, 2], ids=["dp2", "ep2"])
def test_eval_on_two_ranks_equals_transformers_on_each_document_alone(checkpoints, reference, tmp_path, ep):
    """Two processes share the rows (and with EP=2 the experts, through the all-to-all): the 7
    documents pack into an odd number of rows, so one rank runs a padding row in the last round."""
    from tests.train.dist_helpers import run_distributed

    docs, masks = sft_documents(LENGTHS, VOCAB, seed=5)
    prefix = write_sft_file(tmp_path / "val", docs, masks, VOCAB)
    ranks = run_distributed(eval_worker, 2, tmp_path, str(checkpoints[1]), str(prefix), ep)
    assert ranks[0] == ranks[1]
    got = ranks[0]
    assert got["rows"] % 2 == 1 and (got["world_size"], got["expert_parallel"]) == (2, ep)
    want = [_doc_loss(reference, d, m) for d, m in zip(docs, masks)]
    for entry, (s, c) in zip(got["documents"], want):
        assert entry["loss_tokens"] == c and entry["loss_sum"] == pytest.approx(s, rel=1e-5)
    assert got["loss"] == pytest.approx(sum(s for s, _ in want) / sum(c for _, c in want), rel=1e-5)


def test_expert_parallel_without_torchrun_is_one_line_exit_2(checkpoints, tmp_path):
    docs, masks = sft_documents(LENGTHS, VOCAB, seed=5)
    prefix = write_sft_file(tmp_path / "val", docs, masks, VOCAB)
    result = _eval(checkpoints[1], "--data", prefix, "--expert-parallel", 2)
    assert result.exit_code == 2 and "torchrun --nproc-per-node 2" in result.output, result.output
