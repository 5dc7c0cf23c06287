"""GRPO with the vLLM rollout seam, without vLLM: every update is pushed and fingerprinted, nothing is left staged.

The engine is tests/support/fake_engine.py behind `VllmEngine` (transformers' GptOssForCausalLM in its own
process, the same JSON protocol and pushes as vLLM), on the tiny model with head size 64. What is
checked: the engine loads every version's weights from an absolute folder inside rl.rollout.stage_dir;
each push's fingerprint lies within its budget; a skipped push stops the run naming the cause ("still
serves version 0"), after saving the policy; and no `gptoss-rl-weights-*` folder is left after a run that
succeeds, fails, or is ended by SIGTERM.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptoss_cli.errors import TrainingError
from gptoss_cli.run.worker import run_worker
from gptoss_cli.train.progress import TrainStarted
from tests.rl.helpers import TINY, grpo_job, metrics, write_inputs
from tests.support.fake_engine import RECORD_ENV, fake_engine_python, records

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
H64 = dataclasses.replace(TINY, head_dim=64)  # vLLM's CPU attention takes 64, not the preset's 16


def _job(root: Path, **changes):
    return grpo_job(root, arch=H64, rollout_engine="vllm", engine_python=fake_engine_python(root / "fake"),
                    stage_dir=str(root / "stage"), global_batch_size=8, micro_batch_size=8, group_size=4,
                    max_new_tokens=4, **changes)


def _staged(root: Path) -> list[str]:
    stage = root / "stage"
    return sorted(p.name for p in stage.iterdir()) if stage.exists() else []


def test_every_update_is_pushed_and_fingerprinted_and_nothing_stays_staged(tmp_path, monkeypatch):
    monkeypatch.setenv(RECORD_ENV, str(tmp_path / "record.jsonl"))
    job = _job(tmp_path, train_iters=3)
    events = []
    result = run_worker(job, progress=events.append)
    rows = metrics(job.run_dir)
    assert [r["weights_version"] for r in rows] == [0, 1, 2]
    for r in rows:  # transformers against gptoss, both fp32: within the budget of the pushed weights
        assert 0 <= r["fingerprint_logp_abs"] <= r["fingerprint_budget"], r
    sent = records(tmp_path / "record.jsonl")
    pushes = [r["folder"] for r in sent if r["op"] == "load_weights"]
    started = [r["model"] for r in sent if r["op"] == "start"]
    assert len(started) == 1 and len(pushes) == 2  # the start, then versions 1 and 2
    stage = (tmp_path / "stage").resolve()
    assert all(Path(f).is_absolute() and Path(f).is_relative_to(stage) for f in started + pushes), started + pushes
    assert _staged(tmp_path) == []
    assert (Path(job.run_dir) / "rollout-engine.log").is_file()
    # the console: which engine, its log, its start-up; the summary: the reward, first and last
    notes = [n for e in events if isinstance(e, TrainStarted) for n in e.notes]
    assert len(notes) == 1 and "rollout engine: vllm fake on cpu" in notes[0] and "rollout-engine.log" in notes[0]
    assert "started in" in notes[0] and str(stage) in notes[0]
    reward = next(m for m in result.shown if m["name"] == "reward_mean")
    assert (reward["first"], reward["last"]) == (rows[0]["reward_mean"], rows[-1]["reward_mean"])


def test_a_skipped_push_stops_the_run_naming_it_after_saving_the_policy(tmp_path, monkeypatch):
    from gptoss_cli.generate.engines.vllm_offline import VllmEngine

    monkeypatch.setenv(RECORD_ENV, str(tmp_path / "record.jsonl"))
    monkeypatch.setattr(VllmEngine, "load_weights", lambda self, folder, method="fresh_model": 0.0)  # the bug
    job = _job(tmp_path, train_iters=3, checkpoint_dir=str(tmp_path / "ckpt"))
    with pytest.raises(TrainingError, match=r"does not serve the policy's weights of version 1") as info:
        run_worker(job)
    assert "still serves version 0's weights" in info.value.hint and "the push did not take" in info.value.hint
    assert "iter_0000001" in info.value.hint and (tmp_path / "ckpt" / "iter_0000001").is_dir()
    assert "rollout-engine.log" in info.value.hint
    assert _staged(tmp_path) == []


def test_sigterm_leaves_nothing_staged(tmp_path):
    tok, prompts = write_inputs(tmp_path / "inputs")
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(json.dumps({
        "base": str(RECIPES / "tiny_cpu_grpo.yaml"), "model": {"architecture": {"head_dim": 64}},
        "checkpoint": {"pretrained": None, "dir": None, "keep_last": None},
        "training": {"train_iters": 1000, "seq_length": 32, "global_batch_size": 8, "micro_batch_size": 8},
        "rl": {"prompts": str(prompts), "tokenizer": str(tok), "group_size": 4, "max_new_tokens": 4,
               "rollout": {"engine": "vllm", "engine_python": fake_engine_python(tmp_path / "fake"),
                           "stage_dir": str(tmp_path / "stage")}},
        "logging": {"run_dir": str(tmp_path / "run")}}))
    record = tmp_path / "record.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "gptoss_cli", "train", "--recipe", str(recipe), "--quiet"],
                            env={**__import__("os").environ, RECORD_ENV: str(record)}, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not any(r["op"] == "load_weights" for r in records(record)):  # training has started pushing
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0].decode()[-2000:]
            time.sleep(0.2)
        assert _staged(tmp_path), "a push is staged while the run trains"
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out[-2000:]
    time.sleep(0.5)  # the watcher of a folder that did not unwind, if any, removes it as the process ends
    assert _staged(tmp_path) == []
