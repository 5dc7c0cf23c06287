"""Ctrl-C or SIGTERM at every point of a save, for every writer: the run ends as that signal, nothing is half-written.

A signal is delivered at the Nth Python call event of a save (tests/support/signal_points.py: counted,
not timed), through the handlers `gptoss` installs, at points spread over the whole save plus the
first call of each landmark (the renames that publish, torch's serialiser, the writes C++ calls back
into, fsync). Each interrupted save goes through the CLI's error handling (`handle_errors`) and must
end with exit 130 ("interrupted:") or 143 ("terminated:"), one line; then:
- training (DCP): `latest` names the last complete checkpoint (the previous one, or the one being saved
  if the signal landed after it was published), no `.iter_*.partial` is left, and a resume trains on;
- convert (`WRITERS`: hybrid, hf, megatron, peft, gguf): DST does not exist and nothing is left beside it,
  and converting again succeeds;
- a GRPO run's rollout file (rl.save_rollouts, rl/rollout_file.py): it is whole or absent, nothing beside it.

A new writer is one entry in `WRITERS` (a writer of one file names it: `Writer(source, "gguf", "dst.gguf")`).
GPTOSS_SAVE_POINTS raises the number of spread points (default 4 per writer, 6 for training) for a
longer local run: `GPTOSS_SAVE_POINTS=200 python -m pytest tests/faults/test_save_signals.py`.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import typer
from typer.testing import CliRunner

from gptoss_cli.checkpoint.convert import convert
from gptoss_cli.cli import app
from gptoss_cli.cli.app import handle_errors, install_signal_handlers
from tests.faults.conftest import TRAIN_FAST, assert_one_line, leftovers
from tests.faults.test_train_faults import latest_step
from tests.support.signal_points import count_points, signal_at, sweep_points

POINTS = int(os.environ.get("GPTOSS_SAVE_POINTS", "0")) or None
EXPECTED = {signal.SIGINT: (130, "interrupted:"), signal.SIGTERM: (143, "terminated:")}


@pytest.fixture
def cli_handlers():
    """The SIGINT / SIGTERM handlers `gptoss` installs in main(), restored afterwards."""
    before = {s: signal.getsignal(s) for s in EXPECTED}
    install_signal_handlers()
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def through_the_cli(save: Callable[[], object]) -> tuple[int | None, str]:
    """(exit code, stderr) of `save` run as a command runs it; (None, "") when it returned normally."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # where the CLI's error console prints, at the time it prints
        try:
            handle_errors(save)()
        except typer.Exit as exc:
            return exc.exit_code, err.getvalue()
    return None, err.getvalue()


def points(save: Callable[[Path], Callable[[], object]], scratch: Path, spread: int) -> list[int]:
    """The sweep over `save(folder)()`'s call events, counted on its second run into `scratch` (the first
    one imports what the code imports lazily)."""
    save(scratch / "first")()
    total, landmarks, _ = count_points(save(scratch / "second"))
    return sweep_points(total, landmarks, POINTS or spread)


# --- convert's writers --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Writer:
    """`convert --to <to>` from the fixture named `source` (a folder)."""

    source: str
    to: str
    dst: str = "dst"  # a GGUF is one file, named .gguf


WRITERS = {
    "hybrid": Writer("tiny_hf", "hybrid"),
    "hf": Writer("tiny_hybrid", "hf"),
    "megatron": Writer("tiny_hf", "megatron"),
    "peft": Writer("lora_ckpt", "peft"),
    "gguf": Writer("tiny_hf", "gguf", "dst.gguf"),
}


@pytest.fixture(scope="module")
def lora_ckpt(tiny_hybrid, tmp_path_factory) -> Path:
    """The checkpoint.dir of a 1-step LoRA run on tiny_hybrid (the PEFT writer's source)."""
    from gptoss_cli.checkpoint.load import checkpoint_architecture
    from gptoss_cli.run.worker import run_worker
    from tests.train.jobs import train_job

    run = tmp_path_factory.mktemp("lora-run")
    arch, _ = checkpoint_architecture(tiny_hybrid)
    run_worker(train_job(run / "run", arch=arch, pretrained=str(tiny_hybrid), lora_rank=2, lora_alpha=4.0,
                         lora_targets=["linear_qkv", "linear_fc1"], seq_length=16, global_batch_size=2,
                         micro_batch_size=1, train_iters=1, save_interval=1, checkpoint_dir=str(run / "ckpt"),
                         use_distributed_optimizer=False))
    return run / "ckpt"


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_a_signal_anywhere_in_a_convert_write_ends_as_that_signal_with_nothing_at_dst(
        name, request, tmp_path, cli_handlers):
    writer = WRITERS[name]
    src = request.getfixturevalue(writer.source)
    out = tmp_path / "out"
    out.mkdir()

    def save(dst: Path) -> Callable[[], object]:
        return lambda: convert(str(src), dst, to=writer.to, dtype="float32")

    def run_to(folder: Path) -> Callable[[], object]:  # DST inside `folder`: counted and interrupted alike
        folder.mkdir(parents=True, exist_ok=True)  # before the counted calls (mkdir is a landmark)
        return save(folder / writer.dst)

    sweep = points(run_to, tmp_path, spread=4)
    dst = out / writer.dst
    for i, point in enumerate(sweep):
        signum = (signal.SIGINT, signal.SIGTERM)[i % 2]
        with signal_at(point, signum) as where:
            code, err = through_the_cli(run_to(out))
        assert where["fired"], (point, sweep)
        want, label = EXPECTED[signum]
        assert code == want, (where, code, err)
        assert_one_line((code, err), want, "nothing was left half-written", prefix=label)
        # DST is absent, or complete when the signal came after it was put in place (the command still stops)
        assert leftovers(out) == [] and [p.name for p in out.iterdir()] in ([], [dst.name]), (where, list(out.iterdir()))
        if dst.exists():
            assert _sizes(dst) == _sizes(tmp_path / "second" / writer.dst), where
            shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
    save(dst)()  # converting again: nothing in the way
    assert dst.exists() and leftovers(out) == []


def _sizes(folder: Path) -> dict[str, int]:
    """Every file of an output and its size, but the files recording where and when it was made."""
    if folder.is_file():
        return {folder.name: folder.stat().st_size}
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")
            if p.is_file() and p.suffix != ".json" and p.name != "common.pt"}


# --- GRPO's rollout files (rl.save_rollouts) -----------------------------------------------------------------
def test_a_signal_anywhere_in_a_rollout_file_write_leaves_it_whole_or_absent(tmp_path, cli_handlers):
    pq = pytest.importorskip("pyarrow.parquet")
    from gptoss_cli.rl.rollout_file import file_name, write_rollout_file

    rows = [{"step": 1, "rank": 0, "prompt": i, "prompt_source": "p.jsonl:1", "prompt_ids": [1, 2], "prompt_text": "p",
             "completion_ids": [3, 4, 5], "completion_text": "c", "final_text": "", "finish": "stop", "reward": 1.0,
             "advantage": 0.0, "engine_logprobs": [-1.0] * 3, "trainer_logprobs": [-1.0] * 3, "is_weights": [1.0] * 3}
            for i in range(8)]

    def save(folder: Path) -> Callable[[], object]:
        return lambda: write_rollout_file(folder, 1, rows, [None] * 8, {})

    save(tmp_path / "warm")()  # pyarrow's first table of a schema costs more calls than the ones after it
    for i, point in enumerate(points(save, tmp_path, spread=6)):
        folder = tmp_path / f"rollouts-{i}"  # each save as the counted one: into a new folder
        signum = (signal.SIGINT, signal.SIGTERM)[i % 2]
        with signal_at(point, signum) as where:
            code, err = through_the_cli(save(folder))
        assert where["fired"], point
        want, label = EXPECTED[signum]
        assert_one_line((code, err), want, "nothing was left half-written", prefix=label)
        path = folder / file_name(1)
        assert not path.exists() or pq.read_table(path).num_rows == 8, where
        assert not folder.exists() or leftovers(folder) == [], where


# --- training's DCP checkpoints ---------------------------------------------------------------------------
def _train_args(ckpt: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--recipe", "tiny_cpu_ep2", f"checkpoint.dir={ckpt}", f"logging.run_dir={run}", *TRAIN_FAST,
            "--nproc-per-node", "1", "parallelism.expert_model_parallel_size=1", "checkpoint.save_interval=1",
            "-q", *extra]


def test_a_signal_anywhere_in_a_training_save_keeps_latest_complete_and_the_run_resumes(
        tmp_path, monkeypatch, cli_handlers):
    """The second save of a run is interrupted at every point of the sweep in turn (each time `latest`
    must name a complete checkpoint and nothing partial may remain), then once more for good: the run
    ends 130 with `latest` on step 1, and a resume trains steps 2 and 3."""
    import gptoss_cli.train.loop as loop

    real, ckpt, seen = loop.save_checkpoint, tmp_path / "ckpt", []

    def interrupted_saves(ckpt_dir, **kw):
        if kw["step"] != 2:
            return real(ckpt_dir, **kw)
        sweep = points(lambda folder: lambda: real(folder, **kw), tmp_path, spread=6)
        for i, point in enumerate(sweep):
            signum = (signal.SIGINT, signal.SIGTERM)[i % 2]
            with signal_at(point, signum) as where:
                code, err = through_the_cli(lambda: real(ckpt_dir, **kw))
            want, label = EXPECTED[signum]
            seen.append(where["where"])
            assert where["fired"] and code == want and err.startswith(label), (where, code, err)
            assert latest_step(ckpt) in (1, 2) and leftovers(ckpt) == [], (where, sorted(os.listdir(ckpt)))
            shutil.rmtree(ckpt / "iter_0000002", ignore_errors=True)  # the next point starts from step 1 again
            (ckpt / "latest").write_text("iter_0000001\n")
        with signal_at(sweep[len(sweep) // 2], signal.SIGINT):
            return real(ckpt_dir, **kw)

    monkeypatch.setattr(loop, "save_checkpoint", interrupted_saves)
    result = CliRunner().invoke(app, _train_args(ckpt, tmp_path / "run", "training.train_iters=3"))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert_one_line((result.exit_code, result.output), 130, "nothing was left half-written", prefix="interrupted:")
    assert len(seen) >= 6 and latest_step(ckpt) == 1 and leftovers(ckpt) == []
    monkeypatch.setattr(loop, "save_checkpoint", real)
    resumed = CliRunner().invoke(app, _train_args(ckpt, tmp_path / "run2", "training.train_iters=3"))
    assert resumed.exit_code == 0, resumed.output
    assert latest_step(ckpt) == 3 and sorted(p.name for p in ckpt.glob("iter_*")) == [
        "iter_0000001", "iter_0000002", "iter_0000003"]


# --- checkpoint.async_save: the main thread's part of a save, to its publication ------------------------------
def test_a_signal_anywhere_in_an_async_save_keeps_latest_complete_and_the_run_resumes(
        tmp_path, monkeypatch, cli_handlers):
    """As above with checkpoint.async_save: the signal lands anywhere in the training thread's part of the save
    of step 2 (the copy, the upload's start, the wait for it, the check and the publication), the way out
    (`guarded`: `abandon`) finishes the upload and publishes it or removes its folder; nothing is left in
    flight, `latest` names a complete checkpoint, and a resume trains on."""
    from gptoss_cli.train.async_save import AsyncCheckpointer

    real, ckpt, seen = AsyncCheckpointer.save, tmp_path / "ckpt", []

    def whole(saver, folder: Path, kw: dict) -> Callable[[], object]:
        def run():
            with saver.guarded():  # what the loop's block does on the way out
                real(saver, folder, **kw)
                saver.wait()
        return run

    def interrupted_saves(self, ckpt_dir, **kw):
        if kw["step"] != 2:
            return real(self, ckpt_dir, **kw)
        self.wait()  # step 1's upload published first, as the real save of step 2 does
        # counted as the sweep runs it, through the CLI's wrapper: a landmark early in the save is hit there
        sweep = points(lambda folder: lambda: through_the_cli(whole(self, folder, kw)), tmp_path, spread=6)
        for i, point in enumerate(sweep):
            signum = (signal.SIGINT, signal.SIGTERM)[i % 2]
            with signal_at(point, signum) as where:
                code, err = through_the_cli(whole(self, ckpt_dir, kw))
            want, label = EXPECTED[signum]
            seen.append(where["where"])
            assert where["fired"] and code == want and err.startswith(label), (where, code, err)
            assert self.pending is None, where
            assert latest_step(ckpt) in (1, 2) and leftovers(ckpt) == [], (where, sorted(os.listdir(ckpt)))
            shutil.rmtree(ckpt / "iter_0000002", ignore_errors=True)
            (ckpt / "latest").write_text("iter_0000001\n")
        with signal_at(sweep[len(sweep) // 2], signal.SIGINT):
            return whole(self, ckpt_dir, kw)()

    monkeypatch.setattr(AsyncCheckpointer, "save", interrupted_saves)
    result = CliRunner().invoke(app, _train_args(ckpt, tmp_path / "run", "training.train_iters=3",
                                                 "checkpoint.async_save=true"))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert_one_line((result.exit_code, result.output), 130, "nothing was left half-written", prefix="interrupted:")
    assert len(seen) >= 6 and latest_step(ckpt) in (1, 2) and leftovers(ckpt) == []
    monkeypatch.setattr(AsyncCheckpointer, "save", real)
    resumed = CliRunner().invoke(app, _train_args(ckpt, tmp_path / "run2", "training.train_iters=3",
                                                  "checkpoint.async_save=true"))
    assert resumed.exit_code == 0, resumed.output
    assert latest_step(ckpt) == 3 and leftovers(ckpt) == []


# --- checkpoint.save_on_signal: a signal never interrupts a save; the run stops after it --------------------------
@pytest.mark.parametrize("async_save", [False, True])
def test_with_save_on_signal_a_signal_anywhere_in_a_save_lets_it_finish_and_the_run_stops_after_it(
        async_save, tmp_path, monkeypatch, cli_handlers):
    """With checkpoint.save_on_signal the handlers only record a signal: at every point of the save of step 2
    (to its publication, asynchronous or not) the save completes (`latest` on step 2, nothing partial) and the
    signal is recorded; the run then ends after step 2 as the last signal asks, losing no step."""
    import gptoss_cli.train.loop as loop

    real, ckpt, seen = loop.Trainer.save_checkpoint, tmp_path / "ckpt", []

    def whole(trainer) -> Callable[[], object]:
        def run():
            real(trainer, 2)
            if trainer.async_saves is not None:
                trainer._published(trainer.async_saves.wait())
        return run

    def swept(self, done, reason=None):
        if done != 2 or reason is not None:
            return real(self, done, reason)
        whole(self)()  # imports what the save imports lazily
        total, landmarks, _ = count_points(lambda: through_the_cli(whole(self)))
        sweep = sweep_points(total, landmarks, POINTS or 6)
        for i, point in enumerate(sweep):
            signum = (signal.SIGINT, signal.SIGTERM)[i % 2]
            with signal_at(point, signum) as where:
                code, err = through_the_cli(whole(self))
            seen.append(where["where"])
            assert where["fired"] and code is None, (where, code, err)
            assert self.step_end.seen == signum, where
            assert latest_step(ckpt) == 2 and leftovers(ckpt) == [], (where, sorted(os.listdir(ckpt)))
            self.step_end.seen = 0
        self.step_end.seen = signal.SIGTERM  # the last one stands: the run stops after this step
        return None

    monkeypatch.setattr(loop.Trainer, "save_checkpoint", swept)
    args = ["training.train_iters=4", "checkpoint.save_on_signal=true", f"checkpoint.async_save={async_save}"]
    result = CliRunner().invoke(app, _train_args(ckpt, tmp_path / "run", *args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert_one_line((result.exit_code, result.output), 143, "last checkpoint: step 2", "no step since is lost",
                    prefix="terminated:")
    assert len(seen) >= 6 and latest_step(ckpt) == 2 and leftovers(ckpt) == []
    monkeypatch.setattr(loop.Trainer, "save_checkpoint", real)
    resumed = CliRunner().invoke(app, _train_args(ckpt, tmp_path / "run2", *args))
    assert resumed.exit_code == 0, resumed.output
    assert latest_step(ckpt) == 4
