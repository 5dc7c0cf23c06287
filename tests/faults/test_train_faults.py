"""Training state: stopped ranks, Ctrl-C, two runs on one folder, non-finite states, bad resumes, unwritable folders."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.faults.conftest import TRAIN_FAST, assert_one_line, child_env, leftovers, start, wait_for
from tests.support.cli import exit_and_output

TIMEOUT_S = 3  # system.heartbeat_timeout_s for the stopped-rank test


def train_args(ckpt: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--recipe", "tiny_cpu_ep2", f"checkpoint.dir={ckpt}", f"logging.run_dir={run}", *TRAIN_FAST, *extra]


def train_in_process(ckpt: Path, run: Path, *extra: str):
    """One process, EP=1: the cheap way to exercise what does not need two ranks."""
    return exit_and_output(*train_args(ckpt, run, "--nproc-per-node", "1", "parallelism.expert_model_parallel_size=1",
                                       *extra))


def latest_step(ckpt: Path) -> int | None:
    try:
        name = (ckpt / "latest").read_text().strip()
    except OSError:
        return None
    assert (ckpt / name / "train_state.json").is_file() and (ckpt / name / ".metadata").is_file()
    return int(name.split("_")[1])


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_stopped_rank_ends_the_job_promptly_naming_it_and_a_second_run_on_the_folder_fails_at_once(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    job = start(*train_args(ckpt, run, "training.train_iters=100000", "checkpoint.save_interval=1",
                            f"system.heartbeat_timeout_s={TIMEOUT_S}", "-q"), cwd=tmp_path, env=child_env(tmp))
    try:
        wait_for(lambda: latest_step(ckpt), 180, "the first checkpoint", interval=0.1)

        code, out = train_in_process(ckpt, tmp_path / "run2", "-q")
        assert code == 2 and f"checkpoint.dir {ckpt} is in use by another gptoss run (pid {job.pid} on" in out, out
        assert len(out.strip().splitlines()) == 1 and not (tmp_path / "run2" / "metrics.jsonl").exists()

        beat = json.loads(next(tmp.glob("gptoss-heartbeat-*/rank1.json")).read_text())
        os.kill(beat["pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        _, err = job.communicate(timeout=60)
        ended_after = time.monotonic() - t0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert_one_line((job.returncode, err), 1, "worker rank 1 stopped making progress (its process is stopped",
                    f"system.heartbeat_timeout_s={TIMEOUT_S}")
    # the timeout, a poll, and the agent's shutdown of the other rank; not the 600 s collective timeout
    assert ended_after < TIMEOUT_S + 20
    wait_for(lambda: gone(beat["pid"]), 10, "the stopped worker to be gone")
    assert latest_step(ckpt) >= 1


def test_ctrl_c_ends_training_with_one_line_and_the_next_run_resumes_and_cleans_up(tmp_path):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    job = start(*train_args(ckpt, run, "training.train_iters=100000", "checkpoint.save_interval=1", "-q"),
                cwd=tmp_path)
    try:
        wait_for(lambda: latest_step(ckpt), 180, "the first checkpoint", interval=0.1)
        os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert_one_line((job.returncode, err), 130, prefix="interrupted:")
    step = latest_step(ckpt)

    # What a kill during a save leaves: an incomplete checkpoint folder and a pointer's temporary file.
    (ckpt / ".iter_0099999.partial").mkdir(exist_ok=True)
    (ckpt / ".iter_0099999.partial" / "__0_0.distcp").write_bytes(b"\0" * 4096)
    (ckpt / ".latest.tmp").write_text("iter_0099999\n")
    code, out = train_in_process(ckpt, run, f"training.train_iters={step + 1}", "checkpoint.override_lr_schedule=true",
                                 "--json", tmp_path / "r.json")
    assert code == 0, out
    flat = " ".join(out.split())  # rich wraps long lines at the runner's 80 columns
    assert f"note: removed {ckpt / '.iter_0099999.partial'}" in flat and f"note: removed {ckpt / '.latest.tmp'}" in flat
    assert json.loads((tmp_path / "r.json").read_text())["resumed_from"] == str(ckpt / f"iter_{step:07d}")
    assert latest_step(ckpt) == step + 1 and leftovers(ckpt) == []


def test_a_non_finite_state_is_never_saved_nor_made_latest(tmp_path):
    # adam_eps=0 divides 0 by 0 for embedding rows no token of the batch touched: the loss stays
    # finite, the parameters do not.
    ckpt = tmp_path / "ckpt"
    code, out = train_in_process(ckpt, tmp_path / "run", "optimizer.adam_eps=0", "training.train_iters=3",
                                 "checkpoint.save_interval=1", "-q")
    assert code == 1 and len(out.strip().splitlines()) == 1, out
    assert "after step 1" in out and "are not finite (first: model.embedding.word_embeddings.weight)" in out, out
    assert "this state was not saved and `latest` was not created" in out
    assert sorted(p.name for p in ckpt.iterdir()) == [".gptoss.lock"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A one-step checkpoint (one process, EP=1)."""
    root = tmp_path_factory.mktemp("saved")
    code, out = train_in_process(root / "ckpt", root / "run", "training.train_iters=1", "-q")
    assert code == 0, out
    return root / "ckpt"


def test_resume_with_another_architecture_names_the_first_mismatching_tensor(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    code, out = train_in_process(ckpt, tmp_path / "run", "training.train_iters=2", "model.architecture.hidden_size=96",
                                 "checkpoint.override_lr_schedule=true", "-q")
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert ("tensor model.embedding.word_embeddings.weight is [1003, 64] torch.float32 in the checkpoint, "
            "the model has [1003, 96]") in " ".join(out.split()), out


def test_resume_from_a_truncated_shard_names_the_file_and_tensor(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    shard = next((ckpt / "iter_0000001").glob("*.distcp"))
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    code, out = train_in_process(ckpt, tmp_path / "run", "training.train_iters=2", "checkpoint.override_lr_schedule=true",
                                 "-q")
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert f"{shard}: has {shard.stat().st_size} bytes, but tensor " in out and "truncated" in out, out


def test_an_unwritable_checkpoint_dir_fails_at_preflight_before_any_step(tmp_path, tmpfs):
    (tmp_path / "file").write_text("x")
    code, out = train_in_process(tmp_path / "file" / "ckpt", tmp_path / "run", "training.train_iters=2", "-q")
    assert code == 2 and len(out.strip().splitlines()) == 1 and "checkpoint.dir" in out and "Not a directory" in out, out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    ro = tmpfs("1m", read_only=True)
    code, out = train_in_process(ro / "ckpt", tmp_path / "run", "training.train_iters=2", "-q")
    assert code == 2 and f"checkpoint.dir {ro / 'ckpt'} is not writable" in out, out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


HOLD_AND_DIE = textwrap.dedent("""
    import os, signal, sys
    from gptoss_cli.outputs import FolderLock
    FolderLock(sys.argv[1], "checkpoint.dir").acquire()
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path):
    from gptoss_cli.outputs import FolderLock

    proc = subprocess.run([sys.executable, "-c", HOLD_AND_DIE, str(tmp_path)], env=child_env(), timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert "pid" in (tmp_path / FolderLock.NAME).read_text()  # the dead owner's record is still there
    FolderLock(tmp_path, "checkpoint.dir").acquire().release()


def test_a_full_disk_during_a_save_is_one_line_and_leaves_latest_alone(tmp_path, tmpfs):
    small = tmpfs("512k")  # the lock file fits, a checkpoint of the tiny model does not
    code, out = train_in_process(small / "ckpt", tmp_path / "run", "training.train_iters=2", "-q")
    flat = " ".join(out.split())
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert "saving the checkpoint of step 2 failed" in flat and "MB free there" in flat, out
    assert "`latest` was not created" in flat and not (small / "ckpt" / "latest").exists()
    assert leftovers(small / "ckpt") == []


def test_a_disk_that_fills_before_the_run_record_names_it_and_leaves_no_half_written_recipe(tmp_path, tmpfs):
    small = tmpfs("64k")
    run = small / "run"
    run.mkdir()
    fillers = 0
    try:  # fill the file system page by page, then free one page: the run's lock file fits, recipe.json does not
        while True:
            (small / f"fill{fillers}").write_bytes(b"x" * 4096)
            fillers += 1
    except OSError:
        (small / f"fill{fillers}").unlink(missing_ok=True)
    (small / "fill0").unlink()
    code, out = train_in_process(tmp_path / "ckpt", run, "checkpoint.dir=null", "checkpoint.save_interval=null",
                                 "training.train_iters=1", "-q")
    assert_one_line((code, out), 2, f"{run / 'recipe.json'}: No space left on device")
    assert not (run / "recipe.json").exists() and leftovers(run) == []
