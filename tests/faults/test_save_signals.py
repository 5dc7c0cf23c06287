"""Ctrl-C or SIGTERM at every point of a save, for every writer: the run ends as that signal, nothing is half-written.

A signal is delivered at the Nth Python call event of a save (tests/support/signal_points.py: counted,
not timed), through the handlers `gptoss` installs, at points spread over the whole save plus the
first call of each landmark (the renames that publish, torch's serialiser, the writes C++ calls back
into, fsync). Each interrupted save goes through the CLI's error handling (`handle_errors`) and must
end with exit 130 ("interrupted:") or 143 ("terminated:"), one line; then:
- training (DCP): `latest` names the last complete checkpoint (the previous one, or the one being saved
  if the signal landed after it was published), no `.iter_*.partial` is left, and a resume trains on;
- convert (`WRITERS`: hybrid, hf, megatron, peft): DST does not exist and nothing is left beside it,
  and converting again succeeds.

A new writer is one entry in `WRITERS` (a GGUF writer: `"gguf": Writer(source, "gguf")`).
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


WRITERS = {
    "hybrid": Writer("tiny_hf", "hybrid"),
    "hf": Writer("tiny_hybrid", "hf"),
    "megatron": Writer("tiny_hf", "megatron"),
    "peft": Writer("lora_ckpt", "peft"),
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

    sweep = points(save, tmp_path, spread=4)
    for i, point in enumerate(sweep):
        signum = (signal.SIGINT, signal.SIGTERM)[i % 2]
        with signal_at(point, signum) as where:
            code, err = through_the_cli(save(out / "dst"))
        assert where["fired"], (point, sweep)
        want, label = EXPECTED[signum]
        assert code == want, (where, code, err)
        assert_one_line((code, err), want, "nothing was left half-written", prefix=label)
        # DST is absent, or complete when the signal came after it was put in place (the command still stops)
        assert leftovers(out) == [] and [p.name for p in out.iterdir()] in ([], ["dst"]), (where, list(out.iterdir()))
        if (out / "dst").exists():
            assert _sizes(out / "dst") == _sizes(tmp_path / "second"), where
            shutil.rmtree(out / "dst")
    save(out / "dst")()  # converting again: nothing in the way
    assert (out / "dst").is_dir() and leftovers(out) == []


def _sizes(folder: Path) -> dict[str, int]:
    """Every file of an output and its size, but the files recording where and when it was made."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")
            if p.is_file() and p.suffix != ".json" and p.name != "common.pt"}


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
