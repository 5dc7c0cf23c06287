"""`gptoss score` against transformers' GptOssForCausalLM scoring each conversation (document) alone, and its reader.

Reference: transformers' forward of each document by itself (eager attention, fp32), its logits taken
to float64; the trained positions are those the file's mask marks (computed here from the mask, not by
our loader). Tolerance: the fp32 logits of the two implementations agree to 1e-5
(tests/model/test_hybrid_vs_transformers.py); a log-prob z - logsumexp(z) moves by at most twice the
largest logit error, so 1e-4 bounds it with room. Top-K ids are compared where the reference's
neighbouring logits are more than 1e-4 apart (closer ones may swap within that error).
"""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
import torch

from gptoss_cli.score import open_scores
from gptoss_cli.train.data import DataLoaderState, PackedDocumentSource, TokenFileSource
from tests.model.tiny_checkpoints import load_hf_reference, write_converted_pair
from tests.support.cli import run_cli
from tests.train.sft_files import sft_documents, write_sft_file

VOCAB = 1003  # tests/model/conftest.py's tiny transformers config
LENGTHS = [6, 29, 11, 2, 17, 23, 9, 14]
K = 5
ATOL = 1e-4

_score = partial(run_cli, "score")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_converted_pair(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def reference(checkpoints):
    return load_hf_reference(checkpoints[0])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    docs, masks = sft_documents(LENGTHS, VOCAB, seed=5)
    return write_sft_file(tmp_path_factory.mktemp("data") / "val", docs, masks, VOCAB), docs, masks


def expected(reference, docs, masks) -> dict[str, torch.Tensor]:
    """Every trained token's label, log-prob, top-K and tail, in file order, from transformers in float64."""
    rows = {"labels": [], "logprobs": [], "topk_logprobs": [], "topk_ids": [], "tail": [], "gap": []}
    for doc, mask in zip(docs, masks):
        with torch.no_grad():
            logits = reference(input_ids=doc[None]).logits[0, :-1].double()
        trained = mask[1:].bool()
        z, labels = logits[trained], doc[1:][trained]
        lse = torch.logsumexp(z, -1, keepdim=True)
        values, ids = z.topk(K + 1, -1)
        rest = z.scatter(-1, ids[:, :K], float("-inf"))
        rows["labels"].append(labels)
        rows["logprobs"].append((z - lse).gather(1, labels[:, None])[:, 0])
        rows["topk_logprobs"].append(values[:, :K] - lse)
        rows["topk_ids"].append(ids[:, :K])
        rows["tail"].append(torch.logsumexp(rest, -1) - lse[:, 0])
        rows["gap"].append((values[:, :-1] - values[:, 1:]).min(-1).values)
    return {k: torch.cat(v) for k, v in rows.items()}


@pytest.fixture(scope="module")
def want(reference, data):
    return expected(reference, data[1], data[2])


def stored(folder, n: int):
    return open_scores(folder).lookup(torch.arange(n))


@pytest.mark.parametrize("which", [0, 1], ids=["hf", "hybrid"])
def test_stored_scores_equal_transformers_token_for_token(checkpoints, data, want, tmp_path, which):
    out = tmp_path / "scores"
    result = _score(checkpoints[which], "--data", data[0], "--out", out, "--top-k", K, "--seq-length", 32,
                    "--micro-batch-size", 2, "--shard-tokens", 30, "--json", tmp_path / "s.json", "--quiet")
    assert result.exit_code == 0, result.output
    n = len(want["labels"])
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["trained_tokens"] == n and summary["shards"] > 1 and summary["top_k"] == K
    got = stored(out, n)
    assert got.trained.all()
    torch.testing.assert_close(got.logprobs.double(), want["logprobs"], atol=ATOL, rtol=0)
    torch.testing.assert_close(got.topk_logprobs.double(), want["topk_logprobs"], atol=ATOL, rtol=0)
    torch.testing.assert_close(got.tail_logmass.double(), want["tail"], atol=ATOL, rtol=0)
    clear = want["gap"] > ATOL
    assert clear.float().mean() > 0.9  # the comparison below is not vacuous
    assert torch.equal(got.topk_ids[clear], want["topk_ids"][clear])
    # the mean the table reports is minus `gptoss eval`'s loss
    assert summary["mean_logprob"] == pytest.approx(float(want["logprobs"].mean()), abs=ATOL)


def test_mxfp4_experts_score_as_transformers_dequantizes_them(tmp_path):
    hf, _ = write_converted_pair(tmp_path / "ckpt", experts="mxfp4")
    docs, masks = sft_documents(LENGTHS[:4], VOCAB, seed=9)
    prefix = write_sft_file(tmp_path / "val", docs, masks, VOCAB)
    result = _score(hf, "--data", prefix, "--out", tmp_path / "s", "--quiet")
    assert result.exit_code == 0, result.output
    ref = expected(load_hf_reference(hf), docs, masks)
    got = stored(tmp_path / "s", len(ref["labels"]))
    assert got.topk_ids is None  # no --top-k: the log-prob of each trained token only
    torch.testing.assert_close(got.logprobs.double(), ref["logprobs"], atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def scored(checkpoints, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("scored") / "s"
    result = _score(checkpoints[1], "--data", data[0], "--out", out, "--top-k", K, "--seq-length", 32,
                    "--shard-tokens", 25, "--quiet")
    assert result.exit_code == 0, result.output
    return out


def _document_of(docs, tokens: torch.Tensor) -> int | None:
    return next((i for i, d in enumerate(docs) if len(d) == len(tokens) and torch.equal(d, tokens)), None)


def _check_microbatch(scores, mb, docs, masks, want) -> int:
    """The scores found for each trained position of `mb` are transformers' for that document and position."""
    got = scores.for_microbatch(mb)
    starts = np.concatenate([[0], np.cumsum([int(m.sum()) for m in masks])])
    checked = 0
    cu = list(mb.cu_seqlens)
    for a, b in zip(cu[:-1], cu[1:]):
        r, at = divmod(a, mb.tokens.shape[1])
        n = b - a
        d = _document_of(docs, mb.tokens[r, at:at + n])
        if d is None:  # the row's padding
            assert not got.trained[r, at:at + n].any()
            continue
        trained = torch.nonzero(masks[d][1:].bool()).flatten()
        assert torch.equal(torch.nonzero(got.trained[r, at:at + n]).flatten(), trained)
        rows = starts[d] + torch.arange(len(trained))
        torch.testing.assert_close(got.logprobs[r, at + trained].double(), want["logprobs"][rows], atol=ATOL, rtol=0)
        torch.testing.assert_close(got.tail_logmass[r, at + trained].double(), want["tail"][rows], atol=ATOL, rtol=0)
        checked += len(trained)
    return checked


@pytest.mark.parametrize("seq", [29, 64])
def test_a_training_microbatch_finds_its_documents_scores_under_any_packing_and_dp_split(scored, data, want, seq):
    """Training packs at another row length than the scorer did, shuffles the rows and splits them over
    DP=2 ranks; every trained position still gets its own document's scores."""
    prefix, docs, masks = data
    scores = open_scores(scored, data=prefix, top_k=K, vocab_size=VOCAB)
    source = PackedDocumentSource(prefix, seq, seed=3, vocab_size=VOCAB)
    rows = source.num_samples
    checked = 0
    for rank in range(2):
        loader = DataLoaderState(source, global_batch_size=2 * rows, micro_batch_size=1, dp_rank=rank, dp_size=2)
        for mb in loader.step_iterator():  # one epoch and a bit: every row, shuffled, split over the ranks
            checked += _check_microbatch(scores, mb, docs, masks, want)
    assert checked == 2 * len(want["labels"])


def test_context_parallel_slices_get_the_slices_of_the_scores(scored, data):
    prefix = data[0]
    scores = open_scores(scored)
    source = PackedDocumentSource(prefix, 64, seed=1, vocab_size=VOCAB)
    mb = next(DataLoaderState(source, global_batch_size=2, micro_batch_size=2, dp_rank=0, dp_size=1).step_iterator())
    whole = scores.for_microbatch(mb)
    for rank in range(2):
        part = scores.for_microbatch(mb.context_slice(2, rank))
        torch.testing.assert_close(part.topk_logprobs, whole.topk_logprobs[:, rank * 32:(rank + 1) * 32])
        assert torch.equal(part.trained, whole.trained[:, rank * 32:(rank + 1) * 32])


def test_attach_puts_the_scores_in_the_microbatch_extras(scored, data):
    source = PackedDocumentSource(data[0], 32, seed=0, vocab_size=VOCAB)
    mb = next(DataLoaderState(source, global_batch_size=2, micro_batch_size=2, dp_rank=0, dp_size=1).step_iterator())
    got = open_scores(scored).attach(mb).extras
    assert set(got) == {"score_logprobs", "score_topk_ids", "score_topk_logprobs", "score_tail_logmass"}
    assert got["score_topk_ids"].shape == (2, 32, K) and got["score_logprobs"].shape == (2, 32)


def test_a_version_1_file_is_scored_window_by_window(checkpoints, reference, tmp_path):
    from gptoss_cli.data.token_format import token_file_paths, write_atomically, write_token_header

    tokens = torch.randint(0, VOCAB, (53,), generator=torch.Generator().manual_seed(2))
    bin_path, json_path = token_file_paths(tmp_path / "plain")
    write_atomically(bin_path, tokens.numpy().astype(np.uint16))
    write_token_header(json_path, dtype="uint16", num_tokens=53, num_documents=1, vocab_size=VOCAB, eos_token_id=None,
                       tokenizer=None, sources=["test"])
    result = _score(checkpoints[0], "--data", tmp_path / "plain", "--out", tmp_path / "s", "--seq-length", 16, "--quiet")
    assert result.exit_code == 0, result.output
    scores = open_scores(tmp_path / "s", seq_length=16)
    source = TokenFileSource(tmp_path / "plain", 16, seed=4, vocab_size=VOCAB)
    for mb in DataLoaderState(source, global_batch_size=3, micro_batch_size=1, dp_rank=0, dp_size=1).step_iterator():
        got = scores.for_microbatch(mb)
        with torch.no_grad():
            z = reference(input_ids=mb.tokens).logits[0].double()
        want = torch.log_softmax(z, -1).gather(1, mb.labels[0, :, None])[:, 0]
        torch.testing.assert_close(got.logprobs[0].double(), want, atol=ATOL, rtol=0)
    with pytest.raises(Exception, match="row length 16, but training.seq_length is 8"):
        open_scores(tmp_path / "s", seq_length=8)


def score_worker(rank: int, checkpoint: str, prefix: str, out: str, ep: int) -> dict:
    from gptoss_cli.score.command import score

    return score(checkpoint, prefix, out, top_k=K, seq_length=32, device="cpu", expert_parallel=ep,
                 shard_tokens=20).to_json()


def test_two_ranks_under_expert_parallel_write_one_folder_that_reads_back_whole(checkpoints, data, want, tmp_path):
    from tests.train.dist_helpers import run_distributed

    out = tmp_path / "s"
    ranks = run_distributed(score_worker, 2, tmp_path / "dist", str(checkpoints[1]), str(data[0]), str(out), 2)
    assert ranks[0]["world_size"] == 2 and ranks[0]["expert_parallel"] == 2
    assert ranks[0]["data_digest"] == ranks[1]["data_digest"] != ""
    files = sorted(p.name for p in out.iterdir())
    assert any(f.startswith("scores-00000-") for f in files) and any(f.startswith("scores-00001-") for f in files)
    got = stored(out, len(want["labels"]))
    torch.testing.assert_close(got.logprobs.double(), want["logprobs"], atol=ATOL, rtol=0)
    torch.testing.assert_close(got.tail_logmass.double(), want["tail"], atol=ATOL, rtol=0)


def test_a_stale_or_foreign_file_is_refused_naming_both_values(scored, data, tmp_path):
    from gptoss_cli.errors import ConfigError
    from gptoss_cli.score.digests import data_digest

    prefix, docs, masks = data
    other = write_sft_file(tmp_path / "other", [d.flip(0) for d in docs], masks, VOCAB)  # same shape, other tokens
    manifest = json.loads((scored / "manifest.json").read_text())
    stored_digest, new_digest = manifest["data"]["digest"], data_digest(other)
    with pytest.raises(ConfigError) as exc:
        open_scores(scored, data=other)
    assert stored_digest in str(exc.value) and new_digest in str(exc.value) and "\n" not in str(exc.value)
    for kwargs, both in [({"top_k": 8}, ("top-k 5", "top-k is 8")),
                         ({"vocab_size": 2000}, ("vocabulary 1003", "vocabulary is 2000")),
                         ({"model_digest": "sha256:00"}, (manifest["model"]["digest"], "sha256:00")),
                         ({"tokenizer_digest": "sha256:11"}, ("tokenizer None", "tokenizer is sha256:11")),
                         ({"temperature": 2.0}, ("temperature 1.0", "temperature is 2.0"))]:
        with pytest.raises(ConfigError) as exc:
            open_scores(scored, **kwargs)
        assert all(b in str(exc.value) for b in both), str(exc.value)
    open_scores(scored, data=prefix, top_k=K, vocab_size=VOCAB, model_digest=manifest["model"]["digest"],
                temperature=1.0)  # the right values pass


def test_scores_of_other_data_with_the_same_digest_check_skipped_fail_on_the_labels(scored, data, tmp_path):
    """Even with no digest given, a microbatch whose labels are not the stored ones is refused, never misread."""
    from gptoss_cli.errors import ConfigError

    prefix, docs, masks = data
    other = write_sft_file(tmp_path / "other", [(d + 1) % VOCAB for d in docs], masks, VOCAB)
    source = PackedDocumentSource(other, 32, seed=0, vocab_size=VOCAB)
    mb = next(DataLoaderState(source, global_batch_size=1, micro_batch_size=1, dp_rank=0, dp_size=1).step_iterator())
    with pytest.raises(ConfigError, match="in the data but .* in the scores"):
        open_scores(scored).for_microbatch(mb)


def test_an_existing_out_needs_force_and_force_replaces_only_a_score_folder(checkpoints, data, tmp_path):
    out = tmp_path / "s"
    args = (checkpoints[1], "--data", data[0], "--out", out, "--seq-length", 32, "--quiet")
    assert _score(*args).exit_code == 0
    first = (out / "manifest.json").read_text()
    result = _score(*args)
    assert result.exit_code == 2 and "--out exists and is not empty" in result.output, result.output
    result = _score(*args, "--top-k", 3, "--force")
    assert result.exit_code == 0, result.output
    assert (out / "manifest.json").read_text() != first and open_scores(out, top_k=3)
    (out / "notes.txt").write_text("mine")
    result = _score(*args, "--force")
    assert result.exit_code == 2 and "'notes.txt'" in result.output, result.output


@pytest.mark.parametrize("args, message", [
    (("--top-k", 2000), "--top-k 2000 exceeds the model's vocabulary (1003)"),
    (("--temperature", 0), "--temperature 0.0 must be a finite number in [1e-06, 100]"),
    (("--temperature", "nan"), "must be a finite number in [1e-06, 100]"),
    (("--seq-length", 10), "document 1 has 29 tokens"),
])
def test_bad_options_are_one_line_exit_2_and_write_nothing(checkpoints, data, tmp_path, args, message):
    result = _score(checkpoints[1], "--data", data[0], "--out", tmp_path / "s", *args)
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output and not (tmp_path / "s").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_an_opened_file_travels_to_a_spawned_worker_without_its_open_shards(scored, data):
    import pickle

    scores = open_scores(scored)
    before = scores.lookup(torch.arange(10))
    again = pickle.loads(pickle.dumps(scores))
    assert again._files is None
    torch.testing.assert_close(again.lookup(torch.arange(10)).topk_logprobs, before.topk_logprobs)
