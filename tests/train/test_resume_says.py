"""What a resumed or stopped run says (issue 53): a finished run re-run has nothing to do and says so; a resume
is refused only when the learning rate of a step taken or to come would change (the schedule's values, not its
fields), with a hint that says how to train longer; another data.path is refused like another data.blend; a
run stopped by Ctrl-C or SIGTERM says which checkpoint survives and how many steps since are lost.

One process, EP = 1, through the CLI in this process (tests/support/cli.py) unless the check is a function's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gptoss_cli.errors import ConfigError, Terminated
from gptoss_cli.train.optimizer import WarmupCosineLR
from gptoss_cli.train.progress import StepDone
from gptoss_cli.train.resume import check_resume_recipe
from tests.support.cli import exit_and_output
from tests.train.jobs import recipe_config

FAST = ["training.seq_length=16", "training.global_batch_size=4", "precision.params_dtype=fp32",
        "--nproc-per-node", "1", "parallelism.expert_model_parallel_size=1"]


def train(ckpt: Path | None, run: Path, *extra: str) -> tuple[int, str]:
    where = [f"checkpoint.dir={ckpt}"] if ckpt is not None else ["checkpoint.dir=null", "checkpoint.save_interval=null"]
    code, out = exit_and_output("train", "--recipe", "tiny_cpu_ep2", *where, f"logging.run_dir={run}", *FAST, *extra)
    return code, " ".join(out.split())  # rich wraps long lines at the runner's 80 columns


def steps_logged(run: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["rank"] == 0]


# --- a finished run ------------------------------------------------------------------------------
def test_a_finished_run_run_again_has_nothing_to_do_and_says_so(tmp_path):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    code, out = train(ckpt, run, "training.train_iters=2")
    assert code == 0, out
    code, out = train(ckpt, run, "training.train_iters=2", "--json", tmp_path / "r.json")
    assert code == 0 and "nothing to do: already at step 2" in out, out
    assert "training.train_iters" in out  # how to train longer
    assert steps_logged(run) == [1, 2]  # no step trained, no worker started
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["steps"] == 0 and result["final_step"] == 2
    assert result["checkpoint"] == str(ckpt / "iter_0000002")


# --- the schedule's values, not its fields -----------------------------------------------------------
def _saved(step: int, **training) -> dict:
    return {"step": step, "lr_schedule": WarmupCosineLR.from_training(recipe_config(**training).training).state_dict()}


FLAT = dict(lr=3e-4, min_lr=3e-4, warmup_iters=2, train_iters=10)  # a cosine from lr to lr: every step at lr


@pytest.mark.parametrize("now", [dict(FLAT, train_iters=20), dict(FLAT, train_iters=20, lr_decay_style="linear"),
                                 dict(FLAT, train_iters=20, lr_decay_style="constant")])
def test_more_steps_on_an_unchanged_learning_rate_resume(tmp_path, now):
    check_resume_recipe(tmp_path, _saved(10, **FLAT), recipe_config(**now))


def test_a_changed_learning_rate_is_refused_naming_the_step_and_saying_how_to_train_longer(tmp_path):
    cosine = dict(lr=3e-4, min_lr=3e-5, warmup_iters=2, train_iters=10, lr_decay_style="cosine")
    with pytest.raises(ConfigError) as err:
        check_resume_recipe(tmp_path, _saved(10, **cosine), recipe_config(**dict(cosine, train_iters=20)))
    message = str(err.value)
    assert "training.train_iters=20 gives decay_iters 20, the checkpoint's decay_iters is 10" in message
    # the first step whose lr differs: step 4 (lr_at(3)), the first after warmup the longer decay moves
    old, new = WarmupCosineLR(3e-4, 3e-5, 2, 10), WarmupCosineLR(3e-4, 3e-5, 2, 20)
    first = next(s for s in range(20) if old.lr_at(s) != new.lr_at(s))
    assert f"lr of step {first + 1}: {old.lr_at(first):.3g} in the checkpoint's schedule" in message
    assert "training.lr_decay_iters=10" in message  # to train longer on the checkpoint's schedule
    # ... which resumes: the steps after 10 run at min_lr, as the checkpoint's schedule has them
    check_resume_recipe(tmp_path, _saved(10, **cosine), recipe_config(**dict(cosine, train_iters=20, lr_decay_iters=10)))


def test_a_changed_min_lr_is_refused_where_the_schedule_decays_to_it_and_moot_where_it_is_constant(tmp_path):
    cosine = dict(lr=3e-4, min_lr=3e-5, warmup_iters=2, train_iters=10, lr_decay_style="cosine")
    with pytest.raises(ConfigError, match=r"training\.min_lr=1e-05 gives min_lr 1e-05, the checkpoint's min_lr is 3e-05"):
        check_resume_recipe(tmp_path, _saved(4, **cosine), recipe_config(**dict(cosine, min_lr=1e-5)))
    constant = dict(cosine, lr_decay_style="constant")
    check_resume_recipe(tmp_path, _saved(4, **constant), recipe_config(**dict(constant, min_lr=1e-5)))


def test_a_change_to_the_steps_already_taken_is_refused(tmp_path):
    constant = dict(lr=3e-4, warmup_iters=2, lr_decay_style="constant")
    with pytest.raises(ConfigError, match=r"training\.warmup_iters=0 gives warmup_iters 0.*lr of step 1: 0 in the"):
        check_resume_recipe(tmp_path, _saved(5, **constant), recipe_config(**dict(constant, warmup_iters=0)))


# --- the data ------------------------------------------------------------------------------------
def _trained_on(data: dict) -> dict:
    return {"step": 4, "run": {"recipe": {"data": {"kind": "tokens", "path": None, "blend": None, **data}}}}


@pytest.mark.parametrize("saved, now, field", [
    ({"path": "data/a"}, dict(data_path="data/b"), "data.path"),
    ({"path": "data/a"}, dict(data_blend=[{"path": "data/a", "weight": 1.0}]), "data.blend"),
    ({"path": None, "blend": [{"path": "data/a", "weight": 1.0}]}, dict(data_path="data/a"), "data.path"),
    ({"kind": "mock"}, dict(data_path="data/a"), "data.kind"),
])
def test_a_resume_on_other_data_is_refused_with_the_override(tmp_path, saved, now, field):
    cfg = recipe_config(data_kind=now.get("data_kind", "tokens"), **{k: v for k, v in now.items() if k != "data_kind"})
    if "data_blend" in now:
        from gptoss_cli.recipe.schema import BlendSource

        cfg.data.blend = [BlendSource(**b) for b in now["data_blend"]]
    with pytest.raises(ConfigError) as err:
        check_resume_recipe(tmp_path, _trained_on(saved), cfg)
    message = str(err.value)
    assert f"resuming would change the data: {field}" in message and "checkpoint.override_data=true" in message
    cfg.checkpoint.override_data = True
    check_resume_recipe(tmp_path, _trained_on(saved), cfg)


def test_the_same_data_path_spelled_otherwise_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_resume_recipe(tmp_path, _trained_on({"path": "data/a"}), recipe_config(data_kind="tokens",
                                                                                 data_path=str(tmp_path / "data/a")))
    check_resume_recipe(tmp_path, _trained_on({"path": "./data//a"}), recipe_config(data_kind="tokens",
                                                                                     data_path="data/a"))


# --- a stopped run ---------------------------------------------------------------------------------
def _stop_at(monkeypatch, step: int, exc: BaseException) -> None:
    """The run is stopped (Ctrl-C, SIGTERM) right after step `step` was logged, as a signal would."""
    from gptoss_cli.cli.train import TrainProgressBar

    def call(self, event):
        if isinstance(event, StepDone) and event.step == step:
            raise exc

    monkeypatch.setattr(TrainProgressBar, "__call__", call)


def test_ctrl_c_says_which_checkpoint_survives_and_how_many_steps_are_lost(tmp_path, monkeypatch):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    _stop_at(monkeypatch, 3, KeyboardInterrupt())
    code, out = train(ckpt, run, "training.train_iters=6", "checkpoint.save_interval=2")
    assert code == 130 and out.startswith("interrupted: nothing was left half-written"), out
    assert f"last checkpoint: step 2 ({ckpt / 'iter_0000002'})" in out and "1 step since (step 3) is lost" in out, out
    assert len(out.splitlines()) == 1

    # resumed from step 2 and stopped again after step 4, just saved: nothing lost
    _stop_at(monkeypatch, 5, KeyboardInterrupt())
    code, out = train(ckpt, run, "training.train_iters=6", "checkpoint.save_interval=2")
    assert code == 130 and "last checkpoint: step 4" in out and "1 step since (step 5) is lost" in out, out


def test_sigterm_without_checkpoints_says_none_survives(tmp_path, monkeypatch):
    _stop_at(monkeypatch, 2, Terminated())
    code, out = train(None, tmp_path / "run", "training.train_iters=6")
    assert code == 143 and out.startswith("terminated: nothing was left half-written"), out
    assert "last checkpoint: none (checkpoint.dir is not set)" in out and "the 2 steps of this run are lost" in out, out


def test_a_stop_before_the_first_step_of_a_resumed_run_loses_nothing(tmp_path, monkeypatch):
    from gptoss_cli.cli.train import TrainProgressBar

    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    assert train(ckpt, run, "training.train_iters=3", "checkpoint.save_interval=2")[0] == 0

    def call(self, event):  # after the resume, before any step
        raise KeyboardInterrupt

    monkeypatch.setattr(TrainProgressBar, "__call__", call)
    code, out = train(ckpt, run, "training.train_iters=5", "training.lr_decay_style=constant",
                      "checkpoint.override_lr_schedule=true")
    assert code == 130 and "last checkpoint: step 3" in out and "no step since is lost" in out, out


def _token_file(prefix: Path, seed: int) -> str:
    import numpy as np
    import torch

    from gptoss_cli.data.token_format import token_file_paths, write_token_header
    from tests.train.jobs import TINY

    ids = torch.randint(0, TINY.vocab_size, (8 * 16 + 1,), generator=torch.Generator().manual_seed(seed))
    bin_path, json_path = token_file_paths(prefix)
    bin_path.write_bytes(ids.numpy().astype(np.uint16).tobytes())
    write_token_header(json_path, dtype="uint16", num_tokens=len(ids), num_documents=1, vocab_size=TINY.vocab_size,
                       eos_token_id=None, tokenizer=None, sources=["test"])
    return str(prefix)


def test_a_resume_on_another_blend_with_the_override_carries_on_from_the_position(tmp_path):
    import dataclasses

    from gptoss_cli.recipe.schema import BlendSource
    from gptoss_cli.run.worker import run_worker
    from tests.train.workers import tiny_plan

    a, b = _token_file(tmp_path / "a", 1), _token_file(tmp_path / "b", 2)

    def job(blend, steps, **changes):
        plan = tiny_plan(str(tmp_path / "run"), train_iters=steps, checkpoint_dir=str(tmp_path / "ckpt"),
                         data_kind="tokens", lr_decay_style="constant", **changes)
        plan.config.data.blend = [BlendSource(path=p, weight=1.0) for p in blend]
        # the resolved recipe, as `gptoss train` records it in the run (tiny_plan leaves it out)
        return dataclasses.replace(plan, recipe=json.loads(json.dumps(dataclasses.asdict(plan.config), default=str)))

    assert run_worker(job([a, b], 2)).steps == 2
    with pytest.raises(ConfigError, match=r"resuming would change the data: data.blend"):
        run_worker(job([a], 3))
    resumed = run_worker(job([a], 3, override_data=True))
    assert resumed.resumed_from.endswith("iter_0000002") and resumed.steps == 1
