"""A tiny teacher with a skill the tiny student lacks, and distillation jobs for tests.

The skill: the task's conversations are the eight one-word prompts of tests/rl/helpers.py (harmony, empty
system message, about 10 tokens each with the tiny tokenizer) answered by the same eight tokens, the count
COUNT_FROM, COUNT_FROM + 1, ..., COUNT_FROM + 7; the token file trains the answer (its loss mask). The
teacher is the tiny preset (3 blocks) trained on it for TEACHER_STEPS steps by the training loop
(`run_worker`, what `gptoss train` runs), from which it predicts every count token with probability near 1
(its loss on the task falls from about 7 to below 0.1); the student is a tiny model of another depth (2
blocks) from another seed, which predicts them at chance (1/1003). Offline the student learns the count
from the teacher's distributions at the answer's positions; on-policy from the teacher's log-probs of
what the student itself samples after each prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gptoss_cli.data.harmony import HarmonyTokenizer
from gptoss_cli.data.tokenizer import read_tokenizer
from gptoss_cli.model.config import preset
from gptoss_cli.rl.prompts import read_records, render_records
from gptoss_cli.run.worker import run_worker
from tests.rl.helpers import write_inputs
from tests.train.jobs import train_job
from tests.train.sft_files import write_sft_file

TINY = preset("tiny")
STUDENT = TINY.replace(num_hidden_layers=2)
COUNT_FROM, COUNT = 200, 8
SEQ = 32
TEACHER_STEPS = 24


def write_task(folder: Path) -> dict[str, Path]:
    """The task's tokenizer, prompts (JSONL) and token file (prompt + count, the count trained)."""
    tok, prompts = write_inputs(folder)
    htok = HarmonyTokenizer(read_tokenizer(tok, "test"), str(tok))
    docs, masks = [], []
    for p in render_records(read_records(str(prompts)), htok, max_prompt_tokens=SEQ - COUNT):
        ids = list(p.ids) + list(range(COUNT_FROM, COUNT_FROM + COUNT))
        docs.append(torch.tensor(ids))
        masks.append(torch.tensor([0] * len(p.ids) + [1] * COUNT, dtype=torch.uint8))
    data = write_sft_file(folder / "task", docs, masks, TINY.vocab_size)
    return {"tokenizer": tok, "prompts": prompts, "data": data}


def train_teacher(folder: Path, task: dict[str, Path]) -> Path:
    """The teacher's training checkpoint (checkpoint.dir) after TEACHER_STEPS steps on the task."""
    ckpt = folder / "teacher"
    job = train_job(folder / "teacher_run", data_kind="tokens", data_path=str(task["data"]), seq_length=SEQ,
                    global_batch_size=8, micro_batch_size=4, train_iters=TEACHER_STEPS, lr=1e-2, min_lr=1e-2,
                    checkpoint_dir=str(ckpt), seed=7)
    job.config.model.swiglu_kernel = "eager"  # compiling costs more than a tiny step saves
    run_worker(job)
    return ckpt


def distill_job(folder: Path, task: dict[str, Path], teacher: Path, *, distill: dict[str, Any] | None = None,
                **changes: Any):
    """An offline distillation job of the student on the task's token file (model teacher, full vocabulary
    unless `distill` says otherwise), validation on the task itself every step."""
    settings = dict(objective="distill", data_kind="tokens", data_path=str(task["data"]), seq_length=SEQ,
                    global_batch_size=8, micro_batch_size=4, train_iters=6, lr=1e-2, min_lr=1e-2, seed=3,
                    validation_data=str(task["data"]), validation_interval=1)
    settings.update(changes)
    job = train_job(folder, arch=STUDENT, **settings)
    job.config.model.swiglu_kernel = "eager"
    d = job.config.distill
    d.teacher_checkpoint = str(teacher)
    for key, value in (distill or {}).items():
        setattr(d, key, value)
    return job


def metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("rank", 0) == 0]




def ep2_worker(rank: int, root: str, data: str, teacher: str) -> list[dict[str, Any]]:
    """One rank of an offline distillation at EP=2 (2 processes, DP=2): the student's and the teacher's experts
    split over both ranks; the first 2 steps of `distill_job`'s run. Rank 0 returns its metrics."""
    job = distill_job(Path(root) / "ep2", {"data": Path(data)}, Path(teacher), train_iters=2, ep_size=2)
    run_worker(job)
    return metrics(job.run_dir) if rank == 0 else []


__all__ = ["TINY", "STUDENT", "COUNT_FROM", "COUNT", "SEQ", "write_task", "train_teacher", "distill_job", "metrics",
           "ep2_worker"]
