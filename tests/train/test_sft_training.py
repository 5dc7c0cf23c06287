"""Training on version-2 token files: packed whole documents, loss masks, per-document attention.

Reference: a plain HybridModel with the same weights run on each document alone, its labels taken
from the file's mask here (the document's next token where the mask is 1, else ignored); the loss is
the sum over the trained tokens of the global batch / their number. Error model (tests/tolerances.py):
both sides compute every token's loss from the same weights; the order of the sums over tokens
(loss, weight gradients, routed tokens per expert) differs, compounded over the layers.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from gptoss_cli.cli import app
from gptoss_cli.errors import ConfigError
from gptoss_cli.model.expert_names import checkpoint_slots
from gptoss_cli.model.loss import IGNORE_INDEX
from gptoss_cli.parallel.grads import unwrap_model
from gptoss_cli.parallel.state import ParallelState, init_parallel
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.data import DataLoaderState, PackedDocumentSource, build_source
from gptoss_cli.run.worker import run_worker
from gptoss_cli.train.objective import forward_step
from tests.tolerances import assert_tensors_close, reassociation_rel
from tests.schedule.workers import build as build_overlap
from tests.train.dist_helpers import named_grads, run_distributed
from tests.train.jobs import TINY, train_job
from tests.train.sft_files import packed_step_worker, sft_documents, write_sft_file

S = 32
LENGTHS = [5, 30, 12, 19, 2, 9, 17, 26, 8, 3, 20, 25]  # 176 tokens: 6 rows of 32


@pytest.fixture()
def sft_file(tmp_path):
    docs, masks = sft_documents(LENGTHS, TINY.vocab_size)
    return write_sft_file(tmp_path / "sft", docs, masks, TINY.vocab_size), docs, masks


def _alone_labels(doc: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    labels = torch.full_like(doc, IGNORE_INDEX)
    for t in range(len(doc) - 1):
        if mask is None or mask[t + 1]:
            labels[t] = doc[t + 1]
    return labels


def test_rows_hold_every_document_once_with_masked_next_token_labels(sft_file):
    prefix, docs, masks = sft_file
    source = build_source("tokens", path=str(prefix), seq_length=S, seed=0, vocab_size=TINY.vocab_size)
    assert isinstance(source, PackedDocumentSource)
    seen = []
    for j in range(source.num_samples):
        row = source.sample(j)
        assert sum(row.lengths) <= S
        at = 0
        for n in row.lengths:
            match = [d for d in range(len(docs)) if len(docs[d]) == n and torch.equal(docs[d], row.tokens[at:at + n])]
            assert len(match) == 1
            d = match[0]
            seen.append(d)
            assert torch.equal(row.labels[at:at + n], _alone_labels(docs[d], masks[d]))
            at += n
        assert (row.labels[at:] == IGNORE_INDEX).all()  # padding is never a target
    assert sorted(seen) == list(range(len(docs)))
    assert source.efficiency == pytest.approx(sum(LENGTHS) / (source.num_samples * S))


def test_file_without_mask_trains_every_next_token_within_documents(tmp_path):
    docs, _ = sft_documents([4, 7], TINY.vocab_size)
    prefix = write_sft_file(tmp_path / "plain", docs, None, TINY.vocab_size)
    row = PackedDocumentSource(prefix, 16, 0, TINY.vocab_size).row(0)
    expected = torch.cat([_alone_labels(docs[0], None), _alone_labels(docs[1], None)])
    assert torch.equal(row.labels[:11], expected) and row.lengths == [4, 7]


def test_document_longer_than_seq_length_is_a_config_error(sft_file):
    prefix, _, _ = sft_file
    with pytest.raises(ConfigError, match=r"sft\.idx: document 1 has 30 tokens.*training.seq_length=16"):
        PackedDocumentSource(prefix, 16, 0, TINY.vocab_size)


def per_document_reference(docs, masks) -> tuple[dict[str, torch.Tensor], int]:
    """Loss (sum over the trained tokens / their number) and its gradients, every document run alone
    through a plain HybridModel with the weights the training setup starts from (seed 11, aux off)."""
    setup = build_overlap(ParallelState(), overlap=False, pattern=TINY.hybrid_layer_pattern, aux=0.0, seed=11)
    reference = copy.deepcopy(unwrap_model(setup.model)).train()
    trained = sum(int(m[1:].sum()) for m in masks)
    total = torch.zeros(())
    for doc, mask in zip(docs, masks):
        total = total + reference(doc[None]).lm_loss_sum(_alone_labels(doc, mask)[None])
    (total / trained).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.grad)
    return {"loss": total.detach() / trained, **{n: t.detach().clone() for n, t in checkpoint_slots(reference)}}, trained


# A gradient element sums over every token of the global batch (6 rows), through the layers twice.
REL = reassociation_rel(max(6 * S, TINY.hidden_size, TINY.intermediate_size), depth=2 * (2 * TINY.num_hidden_layers + 2))


def test_one_step_loss_and_gradients_equal_each_document_alone(sft_file):
    """The real schedule over a global batch of packed rows (3 microbatches of 2 rows): the loss and
    every finalised gradient equal the per-document reference's sum over trained tokens / their number."""
    prefix, docs, masks = sft_file
    state = init_parallel(1, "cpu")
    setup = build_overlap(state, overlap=False, pattern=TINY.hybrid_layer_pattern, aux=0.0, seed=11)
    source = PackedDocumentSource(prefix, S, 0, TINY.vocab_size)
    assert source.num_samples == 6
    data = DataLoaderState(source, global_batch_size=6, micro_batch_size=2, dp_rank=0, dp_size=1)
    schedule = get_forward_backward_func(setup.config)
    logs = schedule(forward_step_func=forward_step, data_iterator=data.step_iterator(), model=setup.model,
                    num_microbatches=data.num_microbatches)
    got_tokens = float(sum(l["num_tokens"] for l in logs))
    got = {"loss": torch.tensor(float(sum(l["lm_loss_sum"] for l in logs)) / got_tokens), **named_grads(setup.model)}
    want, trained = per_document_reference(docs, masks)
    assert got_tokens == trained
    assert_tensors_close(got, want, REL)


@pytest.mark.parametrize("ep, overlap", [(1, False), (2, True)], ids=["dp2", "ep2-overlap"])
def test_two_ranks_loss_and_gradients_equal_each_document_alone(sft_file, tmp_path, ep, overlap):
    """World 2: DP=2 (plain schedule), or EP=2 with combined 1F1B + delayed wgrad (the schedule plan
    takes the document boundaries). The ranks hold different numbers of trained tokens; the loss is
    still the global sum / the global count, and every gradient equals the per-document reference."""
    prefix, docs, masks = sft_file
    ranks = run_distributed(packed_step_worker, 2, tmp_path, str(prefix), ep, overlap, S, 6)
    want, trained = per_document_reference(docs, masks)
    assert sum(r["tokens"] for r in ranks) == trained
    assert ranks[0]["tokens"] != ranks[1]["tokens"]  # uneven: a division by the local count would show
    loss = sum(r["loss_sum"] for r in ranks) / trained
    assert abs(loss - float(want["loss"])) <= REL * float(want["loss"])
    if overlap:
        assert {r["schedule"] for r in ranks} == {"forward_backward_combined_1f1b"}, ranks[0]["schedule"]
    seen = set()
    for r in ranks:
        seen |= set(r["grads"])
        assert_tensors_close(r["grads"], {k: want[k] for k in r["grads"]}, REL)
    assert seen == set(want) - {"loss"}


def test_train_on_a_v2_file_end_to_end(sft_file, tmp_path):
    prefix, _, _ = sft_file
    job = train_job(tmp_path / "run", data_kind="tokens", data_path=str(prefix), seq_length=S, global_batch_size=6,
                    micro_batch_size=2, train_iters=3, lr=3e-3, checkpoint_dir=str(tmp_path / "ckpt"))
    result = run_worker(job)
    assert result.packing == {"efficiency": pytest.approx(sum(LENGTHS) / (6 * S)), "rows": 6, "seq_length": S}
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert result.losses[-1] < result.losses[0]  # the same 6 rows every step: the loss falls
    # `gptoss eval` reads the run's checkpoint and scores the same trained tokens
    out = CliRunner().invoke(app, ["eval", str(tmp_path / "ckpt"), "--data", str(prefix), "--seq-length", str(S),
                                   "--json", str(tmp_path / "e.json"), "--quiet"])
    assert out.exit_code == 0, out.output
    got = json.loads((tmp_path / "e.json").read_text())
    assert got["loss_tokens"] == sum(int(m[1:].sum()) for m in sft_file[2])
    assert 0 < got["loss"] < result.losses[0]


def test_train_cli_refuses_a_v2_file_whose_documents_do_not_fit(sft_file, tmp_path):
    prefix, _, _ = sft_file
    result = CliRunner().invoke(app, ["train", "--recipe", "tiny_cpu_ep2", "--nproc-per-node", "1",
                                      "parallelism.expert_model_parallel_size=1", "data.kind=tokens",
                                      f"data.path={prefix}", "training.seq_length=16", "training.train_iters=2",
                                      "training.warmup_iters=0",
                                      f"logging.run_dir={tmp_path / 'r'}", f"checkpoint.dir={tmp_path / 'c'}"])
    assert result.exit_code == 1, result.output  # a recipe that breaks a rule (ValidationFailed)
    assert "data.documents_fit" in result.output and "document 1 has 30 tokens" in result.output
    assert "Traceback" not in result.output


def test_train_cli_refuses_a_v2_file_whose_mask_is_missing(sft_file, tmp_path):
    prefix, _, _ = sft_file
    prefix.with_suffix(".mask").unlink()
    result = CliRunner().invoke(app, ["train", "--recipe", "tiny_cpu_ep2", "--nproc-per-node", "1",
                                      "parallelism.expert_model_parallel_size=1", "data.kind=tokens",
                                      f"data.path={prefix}", f"training.seq_length={S}", "training.train_iters=2",
                                      "training.warmup_iters=0", f"logging.run_dir={tmp_path / 'r'}", f"checkpoint.dir={tmp_path / 'c'}"])
    assert result.exit_code == 2, result.output  # a missing file is bad input
    assert "data.path" in result.output and "sft.mask not found" in result.output
    assert "Traceback" not in result.output


def test_train_cli_summary_and_json_report_the_packing(sft_file, tmp_path):
    prefix, _, _ = sft_file
    result = CliRunner().invoke(app, ["train", "--recipe", "tiny_cpu_ep2", "--nproc-per-node", "1",
                                      "parallelism.expert_model_parallel_size=1", "data.kind=tokens",
                                      f"data.path={prefix}", f"training.seq_length={S}", "training.train_iters=1",
                                      "training.warmup_iters=0", "training.global_batch_size=2",
                                      f"logging.run_dir={tmp_path / 'r'}", f"checkpoint.dir={tmp_path / 'c'}",
                                      "--json", str(tmp_path / "t.json")])
    assert result.exit_code == 0, result.output
    efficiency = sum(LENGTHS) / (6 * S)
    assert f"{efficiency:.1%} of 6 rows of {S} tokens" in result.output
    assert json.loads((tmp_path / "t.json").read_text())["packing"] == {
        "efficiency": pytest.approx(efficiency), "rows": 6, "seq_length": S}
