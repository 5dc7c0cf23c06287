"""Temp files: kills at controlled moments never leave DST incomplete or absent, and the next run cleans up."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from typer.testing import CliRunner

from gptoss_cli.cli import app
from gptoss_cli.checkpoint.storage.safetensors_io import CheckpointReader
from tests.faults.conftest import assert_one_line, child_env, leftovers, stop_mid_write
from tests.faults.test_paths import digest


def reaped_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_kill_9_mid_conversion_keeps_the_old_dst_and_the_next_run_removes_the_leftover(tiny_hf, tiny_hybrid, tmp_path):
    dst = tmp_path / "dst"

    def reset():
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(tiny_hybrid, dst)

    reset()
    before = digest(dst)
    args = ["convert", tiny_hf, dst, "--force", "--quiet"]
    proc = stop_mid_write(args, dst, reset)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert digest(dst) == before
    assert leftovers(tmp_path) == [f".dst.partial-{proc.pid}"]

    again = CliRunner().invoke(app, ["convert", str(tiny_hf), str(dst), "--force"])
    assert again.exit_code == 0, again.output
    assert f"note: removed {tmp_path / f'.dst.partial-{proc.pid}'}" in " ".join(again.stderr.split()), again.stderr
    assert leftovers(tmp_path) == []
    with CheckpointReader(dst) as reader:
        assert len(reader.names()) == len(CheckpointReader(tiny_hybrid).names())


def test_sigterm_mid_conversion_removes_its_temporary_folder(tiny_hf, tmp_path):
    dst = tmp_path / "dst"
    proc = stop_mid_write(["convert", tiny_hf, dst, "--quiet"], dst, lambda: shutil.rmtree(dst, ignore_errors=True))
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=60)
    assert_one_line((proc.returncode, err), 143, "nothing was left half-written", prefix="terminated:")
    assert not dst.exists() and leftovers(tmp_path) == []


KILLED_BETWEEN_RENAMES = textwrap.dedent("""
    import os, signal, sys
    from gptoss_cli import outputs
    outputs.exchange = lambda a, b: False  # a file system without RENAME_EXCHANGE: the two-rename commit
    real_rename = os.rename
    def rename(a, b):
        real_rename(a, b)
        if ".old-" in str(b):  # DST is now aside and the new copy not yet in place
            os.kill(os.getpid(), signal.SIGKILL)
    os.rename = rename
    from gptoss_cli.cli import main
    sys.argv = ["gptoss", "convert", sys.argv[1], sys.argv[2], "--force", "--quiet"]
    main()
""")


def test_kill_between_the_two_renames_of_a_commit_is_repaired_by_the_next_run(tiny_hf, tiny_hybrid, tmp_path):
    dst = tmp_path / "dst"
    shutil.copytree(tiny_hybrid, dst)
    before = digest(dst)
    proc = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_RENAMES, str(tiny_hf), str(dst)], env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    stranded = [p for p in leftovers(tmp_path) if ".old-" in p]
    assert not dst.exists() and len(stranded) == 1  # the worst moment: only the aside copy exists

    again = CliRunner().invoke(app, ["convert", str(tiny_hf), str(dst), "--quiet"])  # same command, no --force
    assert again.exit_code == 2 and "DST exists and is not empty" in again.output, again.output
    assert digest(dst) == before  # the old DST is back, byte for byte
    assert leftovers(tmp_path) == []  # and the killed run's complete-but-uncommitted copy is gone


def test_prepare_data_removes_the_temporary_files_of_killed_runs(tmp_path):
    pytest.importorskip("tokenizers")
    from tests.faults.test_tokens import write_tokenizer

    tok = write_tokenizer(tmp_path / "tok")
    (tmp_path / "a.txt").write_text("the quick brown fox\n\njumps over the lazy dog\n")
    pid = reaped_pid()
    for name in (f".corpus.bin.tmp-{pid}", f".corpus.json.tmp-{pid}"):
        (tmp_path / name).write_bytes(b"\0" * 1000)
    alive = tmp_path / f".corpus.bin.tmp-{os.getppid()}"  # a live process's temporary file is not touched
    alive.write_bytes(b"")
    result = CliRunner().invoke(app, ["prepare-data", str(tmp_path / "a.txt"), "--tokenizer", str(tok),
                                      "--out", str(tmp_path / "corpus"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert leftovers(tmp_path) == [alive.name]


def test_replacing_an_existing_dst_is_one_atomic_swap_where_the_file_system_has_it(tmp_path, monkeypatch):
    from gptoss_cli import outputs

    old, new = tmp_path / "dst", tmp_path / ".dst.partial-1"
    for folder, text in ((old, "old"), (new, "new")):
        folder.mkdir()
        (folder / "f").write_text(text)
    if not outputs.exchange(new, old):
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this file system; the two-rename commit is tested above")
    outputs.exchange(new, old)  # swap back

    def no_two_step(*args):
        raise AssertionError("DST was renamed aside: it would be absent until the second rename")

    monkeypatch.setattr(os, "rename", no_two_step)
    outputs.commit(new, old)
    assert (old / "f").read_text() == "new" and not new.exists()


@pytest.mark.parametrize("ending", ["os._exit(130)", "os.kill(os.getpid(), signal.SIGKILL)", "s.remove()", "s.keep()"])
def test_a_scratch_folder_goes_with_its_process_however_it_ends(tmp_path, ending):
    """ScratchFolder (GRPO's staged weight pushes): removed by hand, or by its watcher when the process that made it
    ends without unwinding (a worker's exit on Ctrl-C, SIGKILL); `keep()` leaves it."""
    code = textwrap.dedent(f"""
        import os, signal
        from gptoss_cli.outputs import ScratchFolder
        s = ScratchFolder("gptoss-rl-weights-", {str(tmp_path)!r})
        (s.path / "model.safetensors").write_bytes(b"x" * 1000)
        {ending}
    """)
    subprocess.run([sys.executable, "-c", code], env=child_env(), timeout=60)
    left = [p.name for p in tmp_path.iterdir()]
    deadline = time.monotonic() + 10
    while left and ending != "s.keep()" and time.monotonic() < deadline:  # the watcher's own exit
        time.sleep(0.05)
        left = [p.name for p in tmp_path.iterdir()]
    assert (left != []) == (ending == "s.keep()"), left
