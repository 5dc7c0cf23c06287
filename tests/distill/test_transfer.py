"""Distillation through the training loop on the tiny model: the skill transfers (offline and on-policy) and does
not at training.lr=0; a precomputed teacher is the model teacher at the same K; a stored file of other data, K or
vocabulary is refused naming both values.

The task and the teacher: tests/distill/helpers.py (a 3-block teacher trained to answer eight prompts with a count
of eight tokens; a 2-block student from another seed predicts them at chance). `val_loss` is the student's
cross-entropy on the task's answers (validation every step), the eval loss on the teacher's task.

Thresholds: the teacher's loss ends below 0.2 and the untrained student's held-out loss is near ln(1003) = 6.9,
so "transfers" asks for changes of several nats, far outside the step-to-step noise of a few tenths; at lr=0 the
student's weights do not change, so its held-out loss is the same number at every step (to the rounding of one
fp32 forward, 1e-6) and so is its offline KL over the same eight rows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gptoss_cli.distill.teacher import ModelTeacher, build_teacher_model, open_teacher
from gptoss_cli.errors import ConfigError
from gptoss_cli.parallel.state import init_parallel
from gptoss_cli.run.worker import run_worker
from gptoss_cli.score.digests import data_digest
from gptoss_cli.score.reader import EXTRAS
from gptoss_cli.train.data import DataLoaderState, PackedDocumentSource
from tests.distill.helpers import SEQ, STUDENT, TINY, distill_job, ep2_worker, metrics, train_teacher, write_task
from tests.support.cli import run_cli
from tests.train.dist_helpers import run_distributed
from tests.train.sft_files import write_sft_file

K = 8
OFFLINE_STEPS, ON_POLICY_STEPS = 12, 6


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    task = write_task(root / "task")
    teacher = train_teacher(root, task)
    return root, task, teacher


@pytest.fixture(scope="module")
def offline(world):
    root, task, teacher = world
    trained = distill_job(root / "offline", task, teacher, train_iters=OFFLINE_STEPS,
                          checkpoint_dir=str(root / "offline" / "ckpt"))
    still = distill_job(root / "offline_lr0", task, teacher, train_iters=2, lr=0.0, min_lr=0.0)
    for job in (trained, still):
        run_worker(job)
    return metrics(trained.run_dir), metrics(still.run_dir), root / "offline" / "ckpt"


def test_the_teacher_has_the_skill_and_the_student_lacks_it(world, offline):
    teacher_run = metrics(world[0] / "teacher_run")
    assert teacher_run[-1]["loss"] < 0.2 < 5 < teacher_run[0]["loss"]
    still = offline[1]
    assert still[0]["val_loss"] > 5.5 and still[0]["top1_agreement"] < 0.1


def test_offline_distillation_transfers_the_skill_and_lr0_moves_nothing(offline):
    trained, still, _ = offline
    kl = [r["kl_teacher"] for r in trained]
    val = [r["val_loss"] for r in trained]
    assert kl[-1] < 0.5 * kl[0] and val[-1] < val[0] - 2.0, (kl, val)
    assert trained[-1]["top1_agreement"] > 0.5
    assert trained[0]["loss"] == pytest.approx(trained[0]["kl_teacher"])  # forward_kl, ce_weight 0: the loss is D
    for name in ("kl_teacher", "val_loss"):
        values = [r[name] for r in still]
        assert max(values) - min(values) <= 1e-5 * abs(values[0]), (name, values)


def test_expert_parallel_student_and_teacher_equal_the_single_process_run(world, offline):
    """EP=2 on 2 processes: both models' experts split over the ranks, the teacher's all-to-alls run beside the
    student's; the step's sums add the same fp32 terms in another order (relative rounding 1e-6)."""
    root, task, teacher = world
    ep2 = run_distributed(ep2_worker, 2, root / "ep2_out", str(root), str(task["data"]), str(teacher), timeout=300)[0]
    for a, b in zip(ep2, offline[0][:2]):
        for name in ("loss", "kl_teacher", "top1_agreement", "val_loss"):
            assert a[name] == pytest.approx(b[name], rel=1e-4), (name, a[name], b[name])


def _on_policy(root, task, teacher, pretrained, name, **changes):
    settings = dict(rl_prompts=str(task["prompts"]), rl_tokenizer=str(task["tokenizer"]), group_size=8,
                    max_new_tokens=8, global_batch_size=64, micro_batch_size=32, rl_loss="dapo",
                    train_iters=ON_POLICY_STEPS, lr=2e-3, min_lr=2e-3, pretrained=str(pretrained))
    job = distill_job(root / name, task, teacher, distill={"on_policy": True, "loss": "reverse_kl"},
                      **{**settings, **changes})
    run_worker(job)
    return metrics(job.run_dir)


def test_on_policy_distillation_from_the_offline_student_transfers_and_lr0_moves_nothing(world, offline):
    """From the offline student (its samples start with the teacher's token about half the time), 6 steps of 64
    sampled completions. The reverse KL is estimated from 512 sampled tokens a step (standard error about 0.1 at
    these values), so its fall is asked of two-step means; the held-out loss is exact."""
    root, task, teacher = world
    trained = _on_policy(root, task, teacher, offline[2], "on_policy")
    still = _on_policy(root, task, teacher, offline[2], "on_policy_lr0", lr=0.0, min_lr=0.0, train_iters=2)
    kl = [r["reverse_kl"] for r in trained]
    assert (kl[-1] + kl[-2]) < 0.9 * (kl[0] + kl[1]), kl
    assert trained[-1]["teacher_top1"] > trained[0]["teacher_top1"]
    val = [r["val_loss"] for r in trained]
    assert val[-1] < still[0]["val_loss"] - 0.05, (val, still[0]["val_loss"])
    assert still[0]["val_loss"] == pytest.approx(still[-1]["val_loss"], rel=1e-6)
    assert trained[0]["reverse_kl"] == still[0]["reverse_kl"]  # the same policy and sampling seed: the same samples
    assert all(r["mismatch_kl"] < 1e-6 for r in trained)  # gptoss's engine in fp32: the trainer's own numbers
    assert trained[0]["loss"] == pytest.approx(trained[0]["reverse_kl"], rel=1e-6)  # dapo, one step per rollout


@pytest.fixture(scope="module")
def scores(world):
    root, task, teacher = world
    out = root / f"scores-top{K}"
    result = run_cli("score", teacher, "--data", task["data"], "--top-k", K, "--out", out, "--quiet")
    assert result.exit_code == 0, result.output
    return out


def test_precomputed_equals_the_model_teacher_at_the_same_k_in_the_logged_losses(world, scores):
    """Both compute the teacher's top-K with `gptoss score`'s function, the file on eval's rows (documents packed
    into one row of 4096) and the model on training's rows (one document per row): the same per-document
    forward in fp32 up to the order of sums, 1e-6 in a log-prob, far below the 1e-4 allowed."""
    root, task, teacher = world
    runs = {}
    for mode, extra in (("model", {}), ("precomputed", {"teacher": "precomputed", "scores": str(scores)})):
        job = distill_job(root / f"k-{mode}", task, teacher, distill={"top_k": K, **extra}, train_iters=2)
        run_worker(job)
        runs[mode] = metrics(job.run_dir)
    for a, b in zip(runs["model"], runs["precomputed"]):
        for name in ("loss", "kl_teacher", "top1_agreement", "val_loss"):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), (name, a[name], b[name])


def _cfg(world, **distill):
    root, task, teacher = world
    cfg = distill_job(root / "unused", task, teacher, distill=distill).config
    return cfg


def test_the_stored_file_equals_the_teachers_recomputation_at_training_positions(world, scores):
    root, task, teacher = world
    state = init_parallel(1, "cpu")
    cfg = _cfg(world, top_k=K)
    stored = open_teacher(dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, teacher="precomputed",
                                                                                scores=str(scores))), STUDENT, state)
    model = ModelTeacher(build_teacher_model(cfg, TINY, state), K, 1.0)
    data = DataLoaderState(PackedDocumentSource(task["data"], SEQ, 0, TINY.vocab_size), global_batch_size=8,
                           micro_batch_size=4, dp_rank=0, dp_size=1)
    for mb in data.step_iterator():
        a, b = stored.attach(dataclasses.replace(mb, extras={})), model.attach(dataclasses.replace(mb, extras={}))
        trained = mb.labels != -100
        lp_a, lp_b = a.extras[EXTRAS["topk_logprobs"]][trained], b.extras[EXTRAS["topk_logprobs"]][trained]
        torch.testing.assert_close(lp_a, lp_b, rtol=0, atol=1e-4)
        torch.testing.assert_close(a.extras[EXTRAS["tail_logmass"]][trained], b.extras[EXTRAS["tail_logmass"]][trained],
                                   rtol=1e-4, atol=1e-4)
        # ids agree wherever the neighbouring log-probs are further apart than the error
        gaps = (lp_b[:, :-1] - lp_b[:, 1:]) > 1e-4
        ids_a, ids_b = a.extras[EXTRAS["topk_ids"]][trained], b.extras[EXTRAS["topk_ids"]][trained]
        assert torch.equal(ids_a[:, 0], ids_b[:, 0])
        assert torch.equal(ids_a[:, :-1][gaps], ids_b[:, :-1][gaps])


@pytest.mark.parametrize("change,stored,wanted", [
    ({"top_k": 4}, "top-k 8", "top-k is 4"),
    ({"temperature": 2.0}, "temperature 1.0", "temperature is 2.0"),
])
def test_a_score_file_of_another_setting_is_refused_in_one_line_naming_both(world, scores, change, stored, wanted):
    cfg = _cfg(world, teacher="precomputed", scores=str(scores), top_k=K)
    cfg.distill = dataclasses.replace(cfg.distill, **change)
    with pytest.raises(ConfigError) as err:
        open_teacher(cfg, STUDENT, init_parallel(1, "cpu"))
    line = str(err.value.message)
    assert "\n" not in line and stored in line and wanted in line, line


def test_a_score_file_of_other_data_or_vocabulary_is_refused_naming_both(world, scores):
    root, task, _ = world
    cfg = _cfg(world, teacher="precomputed", scores=str(scores), top_k=K)
    copy = write_task(root / "copy")  # the same conversations in another folder: the same content, accepted
    cfg.data.path = str(copy["data"])
    open_teacher(cfg, STUDENT, init_parallel(1, "cpu"))
    docs = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([9, 8, 7, 6])]
    other = write_sft_file(root / "other", docs, [torch.tensor([0, 1, 1, 1, 1], dtype=torch.uint8),
                                                  torch.tensor([0, 0, 1, 1], dtype=torch.uint8)], TINY.vocab_size)
    cfg.data.path = str(other)
    with pytest.raises(ConfigError) as err:
        open_teacher(cfg, STUDENT, init_parallel(1, "cpu"))
    assert data_digest(task["data"]) in err.value.message and data_digest(other) in err.value.message
    cfg.data.path = str(task["data"])
    with pytest.raises(ConfigError) as err:
        open_teacher(cfg, STUDENT.replace(vocab_size=1004), init_parallel(1, "cpu"))
    assert "vocabulary 1003" in err.value.message and "1004" in err.value.message


def test_a_teacher_checkpoint_of_another_vocabulary_is_refused_naming_both(world):
    cfg = _cfg(world)
    with pytest.raises(ConfigError) as err:
        open_teacher(cfg, STUDENT.replace(vocab_size=1004), init_parallel(1, "cpu"))
    assert "1003" in err.value.message and "1004" in err.value.message and "\n" not in err.value.message
