"""What a long run needs (issue 42): a resume that refuses a changed schedule, checkpoint retention,
validation during training, dataset blends. Tiny runs of a few steps, in this process."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gptoss_cli.checkpoint.formats.training.record import read_train_state
from gptoss_cli.data.token_format import token_file_paths, write_token_header
from gptoss_cli.errors import ConfigError
from gptoss_cli.recipe.schema import BlendSource
from gptoss_cli.train.blend import BlendedSource, blended_source
from gptoss_cli.train.checkpointing import prune_checkpoints
from gptoss_cli.train.evaluate import evaluate
from gptoss_cli.train.loggers import scalar_tags
from gptoss_cli.run.worker import run_worker
from gptoss_cli.train.optimizer import WarmupCosineLR
from gptoss_cli.train.progress import CheckpointSaved
from gptoss_cli.train.report import read_metrics, summarise
from gptoss_cli.train.resume import check_resume_point
from tests.tolerances import reassociation_rel
from tests.train.sft_files import sft_documents, write_sft_file
from tests.train.workers import TINY, tiny_plan

SEQ = 16


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A version-1 token file (windows) and a version-2 one (documents with a loss mask), tiny ids."""
    root = tmp_path_factory.mktemp("tokens")
    ids = torch.randint(0, TINY.vocab_size, (12 * SEQ + 1,), generator=torch.Generator().manual_seed(1))
    bin_path, json_path = token_file_paths(root / "text")
    bin_path.write_bytes(ids.numpy().astype(np.uint16).tobytes())
    write_token_header(json_path, dtype="uint16", num_tokens=len(ids), num_documents=1, vocab_size=TINY.vocab_size,
                       eos_token_id=None, tokenizer=None, sources=["test"])
    docs, masks = sft_documents([9, 16, 5, 12, 7, 14, 11, 6, 13], TINY.vocab_size, seed=2)
    return {"text": root / "text", "sft": write_sft_file(root / "sft", docs, masks, TINY.vocab_size)}


def _records(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["rank"] == 0]


# --- retention and the resume schedule ------------------------------------------------------------
def test_retention_keeps_the_newest_every_nth_and_latest_and_a_changed_schedule_is_refused(tmp_path):
    ckpt, saved = tmp_path / "ckpt", []
    run_worker(tiny_plan(str(tmp_path / "run"), train_iters=4, checkpoint_dir=str(ckpt), save_interval=1, keep_last=1,
                         keep_every=2), saved.append)
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    assert (ckpt / "latest").read_text().strip() == "iter_0000004"
    assert [[p.rsplit("/", 1)[1] for p in e.removed] for e in saved if isinstance(e, CheckpointSaved)] == \
        [[], ["iter_0000001"], [], ["iter_0000003"]]

    # Resuming with another train_iters would decay over another length: refused before any worker
    # starts (train's pre-launch check), naming both values.
    longer = tiny_plan(str(tmp_path / "run2"), train_iters=6, checkpoint_dir=str(ckpt))
    with pytest.raises(ConfigError) as err:
        check_resume_point(longer.config)
    message = str(err.value)
    assert "training.train_iters=6" in message and "decay_iters 6" in message and "is 4" in message
    assert "checkpoint.override_lr_schedule=true" in message and len(message.splitlines()) == 1
    lower = tiny_plan(str(tmp_path / "run2"), train_iters=4, lr=1e-4, checkpoint_dir=str(ckpt))
    with pytest.raises(ConfigError, match=r"training.lr=0.0001 gives max_lr 0.0001, the checkpoint's max_lr is 0.003"):
        run_worker(lower)

    # With the override the run continues on the recipe's schedule.
    longer.config.checkpoint.override_lr_schedule = True
    resumed = run_worker(longer)
    assert resumed.resumed_from.endswith("iter_0000004") and resumed.steps == 2
    lrs = [r["lr"] for r in _records(tmp_path / "run2")]
    want = WarmupCosineLR.from_training(longer.config.training)
    assert lrs == [want.lr_at(s) for s in (4, 5)]


def test_pruning_never_deletes_what_latest_names(tmp_path):
    for step in (1, 2, 3, 4):
        (tmp_path / f"iter_{step:07d}").mkdir()
    (tmp_path / "latest").write_text("iter_0000001\n")  # e.g. pointed back by hand
    removed = prune_checkpoints(tmp_path, keep_last=1)
    assert sorted(p.name for p in removed) == ["iter_0000002", "iter_0000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "iter_0000004", "latest"]


# --- validation -------------------------------------------------------------------------------------
def test_validation_logs_the_held_out_loss_that_gptoss_eval_computes(tmp_path, files):
    run = tmp_path / "run"
    result = run_worker(tiny_plan(str(run), train_iters=3, seq_length=SEQ, checkpoint_dir=str(tmp_path / "ckpt"),
                                  validation_data=str(files["sft"]), validation_interval=2))
    records = _records(run)
    assert [r["step"] for r in records if "val_loss" in r] == [2, 3]
    last = records[-1]
    scored = evaluate(result.checkpoint, files["sft"], seq_length=SEQ, dtype=torch.float32)
    # the same rows and trained tokens; the two sums differ by their order only
    assert last["val_tokens"] == scored.loss_tokens > 0
    rel = reassociation_rel(n_terms=scored.loss_tokens + TINY.vocab_size)
    assert last["val_loss"] == pytest.approx(scored.loss, rel=rel)
    assert last["val_perplexity"] == pytest.approx(math.exp(last["val_loss"]), rel=1e-12)
    assert scalar_tags(last)["train/val_loss"] == last["val_loss"]  # TensorBoard / W&B
    assert summarise(read_metrics(run))["curves"]["val_loss"]["last"] == last["val_loss"]  # the report


def test_validation_iters_scores_that_many_global_batches_in_file_order(tmp_path, files):
    run = tmp_path / "run"
    result = run_worker(tiny_plan(str(run), train_iters=1, seq_length=SEQ, global_batch_size=2, micro_batch_size=1,
                                  checkpoint_dir=str(tmp_path / "ckpt"), validation_data=str(files["text"]),
                                  validation_iters=2))
    (record,) = _records(run)
    assert record["val_tokens"] == 2 * 2 * SEQ  # 2 batches of 2 windows, every next token trained
    full = evaluate(result.checkpoint, files["text"], seq_length=SEQ, dtype=torch.float32)
    assert full.loss_tokens > record["val_tokens"]


# --- dataset blends ---------------------------------------------------------------------------------
class _Counted:
    def __init__(self, n: int):
        self.num_samples, self.seq_length = n, SEQ

    def sample(self, i: int) -> int:
        return i


def _megatron_helpers():
    """megatron-core's compiled dataset helpers, loaded alone (importing megatron.core takes seconds)."""
    import importlib.machinery
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core (the test extra) is the reference")
    for root in spec.submodule_search_locations:
        for path in (Path(root) / "core" / "datasets").glob("helpers_cpp*.so"):
            loader = importlib.machinery.ExtensionFileLoader("helpers_cpp", str(path))
            module = importlib.util.module_from_spec(importlib.util.spec_from_loader("helpers_cpp", loader))
            loader.exec_module(module)
            return module
    pytest.skip("megatron-core's compiled dataset helpers are not installed")


def test_the_blend_follows_megatrons_blending_indices():
    helpers = _megatron_helpers()
    weights, n = np.array([0.5, 0.3, 0.2]), 997
    dataset, sample = np.zeros(n, dtype=np.int16), np.zeros(n, dtype=np.int64)
    helpers.build_blending_indices(dataset, sample, weights, 3, n, False)
    blend = BlendedSource([("a", 5.0), ("b", 3.0), ("c", 2.0)], [_Counted(10)] * 3)
    assert [blend.assignment(i) for i in range(n)] == list(zip(dataset.tolist(), sample.tolist()))


def test_each_file_gives_every_sample_once_before_it_repeats(files):
    blend = blended_source([(str(files["text"]), 1.0), (str(files["sft"]), 3.0)], SEQ, seed=5,
                           vocab_size=TINY.vocab_size)
    per_file: dict[int, list[int]] = {0: [], 1: []}
    for i in range(80):
        k, n = blend.assignment(i)
        per_file[k].append(blend.sources[k].sample_at(n))
    for k, rows in per_file.items():
        size = blend.sources[k].num_samples
        assert len(rows) > size  # the file was exhausted and went on
        assert sorted(rows[:size]) == list(range(size)) and sorted(rows[size:2 * size]) == sorted(set(rows[size:2 * size]))


def test_a_blend_resumes_where_it_stopped_and_refuses_another_blend(tmp_path, files):
    blend = [BlendSource(str(files["text"]), 2.0), BlendSource(str(files["sft"]), 1.0)]  # windows and packed rows
    plan = dict(seq_length=SEQ, data_kind="tokens", data_blend=blend)
    full = run_worker(tiny_plan(str(tmp_path / "full"), train_iters=4, **plan))
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(_Stop):
        run_worker(tiny_plan(str(tmp_path / "a"), train_iters=4, checkpoint_dir=ckpt, save_interval=2, **plan),
                   _stop_after_save(2))
    state = read_train_state(tmp_path / "ckpt" / "iter_0000002")["blend"]
    assert state["position"] == 2 * 4 and sum(state["counts"]) == 8 and state["counts"][0] > state["counts"][1]
    resumed = run_worker(tiny_plan(str(tmp_path / "b"), train_iters=4, checkpoint_dir=ckpt, **plan))
    assert resumed.losses == full.losses[2:]  # the same samples after the resume, bit for bit

    other = [dataclasses.replace(blend[0], weight=1.0), blend[1]]
    with pytest.raises(ConfigError, match="the checkpoint trained on the blend"):
        run_worker(tiny_plan(str(tmp_path / "c"), train_iters=6, checkpoint_dir=ckpt, override_lr_schedule=True,
                             **{**plan, "data_blend": other}))


class _Stop(Exception):
    pass


def _stop_after_save(step: int):
    def progress(event):
        if isinstance(event, CheckpointSaved) and event.step == step:
            raise _Stop(step)
    return progress


def test_validation_on_two_expert_parallel_ranks_equals_eval_in_one_process(tmp_path, files):
    """EP=2 on 2 processes: each rank scores every other of the file's 7 packed rows, the rank left
    without one in the last round runs a padding row (so the experts' all-to-alls stay matched), and
    the reduced loss is `gptoss eval`'s in one process."""
    from tests.train.dist_helpers import run_distributed
    from tests.train.workers import run_plan_worker

    plan = tiny_plan(str(tmp_path / "run"), ep_size=2, train_iters=1, seq_length=SEQ, micro_batch_size=1,
                     checkpoint_dir=str(tmp_path / "ckpt"), validation_data=str(files["sft"]))
    run_distributed(run_plan_worker, 2, tmp_path / "out", plan)
    (record,) = _records(tmp_path / "run")
    scored = evaluate(tmp_path / "ckpt", files["sft"], seq_length=SEQ, dtype=torch.float32)
    assert scored.rows % 2 == 1 and record["val_tokens"] == scored.loss_tokens
    rel = reassociation_rel(n_terms=scored.loss_tokens + TINY.vocab_size, depth=2 * TINY.num_hidden_layers)
    assert record["val_loss"] == pytest.approx(scored.loss, rel=rel)
