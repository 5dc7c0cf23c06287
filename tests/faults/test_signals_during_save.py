"""Ctrl-C and SIGTERM that arrive while DCP writes a checkpoint: DCP wraps them into its own exception, but
they still end the run as an interruption (exit 130 / 143, 'interrupted' / 'terminated'), never as a failed
save; the partial folder is removed and `latest` stays on the last complete checkpoint. The same, and a full
disk, while `convert --to megatron` writes its torch.save'd chunks."""

from __future__ import annotations

import errno
import io
import os
import signal

import pytest
import torch.distributed.checkpoint.filesystem as dcp_fs

from gptoss_cli.errors import Terminated
from tests.faults.conftest import assert_one_line, leftovers
from tests.faults.test_train_faults import latest_step, train_in_process


@pytest.mark.parametrize("signal_exc, code, label", [(KeyboardInterrupt, 130, "interrupted:"),
                                                     (Terminated, 143, "terminated:")])
def test_a_signal_during_the_second_save_ends_the_run_as_that_signal(tmp_path, monkeypatch, signal_exc, code, label):
    real = dcp_fs._FileSystemWriter.write_data
    saves = []

    def write_data(self, plan, planner):  # the signal handler raises in the thread that writes, as SIGINT does
        saves.append(1)
        if len(saves) == 2:
            raise signal_exc()
        return real(self, plan, planner)

    monkeypatch.setattr(dcp_fs._FileSystemWriter, "write_data", write_data)
    ckpt = tmp_path / "ckpt"
    got, out = train_in_process(ckpt, tmp_path / "run", "training.train_iters=3", "checkpoint.save_interval=1", "-q")
    assert len(saves) == 2
    assert_one_line((got, out), code, "nothing was left half-written", prefix=label)
    assert "save" not in out  # not reported as a failed save
    assert latest_step(ckpt) == 1 and leftovers(ckpt) == [] and not (ckpt / "iter_0000002").exists()


class _ShardFile(io.FileIO):
    """A `convert --to megatron` shard file whose `at`-th write is where a signal lands or the disk fills."""

    def __init__(self, path, mode, action, at: int):
        super().__init__(path, mode)
        self._action, self._at, self._n = action, at, 0

    def write(self, data):
        self._n += 1
        if self._n == self._at:
            self._action()
        return super().write(data)


def _full_disk():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("action, code, prefix, needle", [
    (lambda: signal.raise_signal(signal.SIGINT), 130, "interrupted:", "nothing was left half-written"),
    (lambda: signal.raise_signal(signal.SIGTERM), 143, "terminated:", "nothing was left half-written"),
    (_full_disk, 2, "error:", "__0_0.distcp: No space left on device"),
], ids=["ctrl-c", "sigterm", "enospc"])
def test_a_signal_or_a_full_disk_inside_a_megatron_shard_write_is_that_not_a_cpp_error(
        tiny_hf, tmp_path, monkeypatch, action, code, prefix, needle):
    """torch.save wrote each chunk into the shard itself, calling the file's write from C++: a signal handler's
    exception or ENOSPC raised there came out as a RuntimeError traceback, exit 1."""
    from typer.testing import CliRunner

    from gptoss_cli.checkpoint.formats.megatron import writer
    from gptoss_cli.cli import app
    from gptoss_cli.cli.app import _terminate

    monkeypatch.setattr(writer, "open", lambda path, mode: _ShardFile(path, mode, action, at=3), raising=False)
    before = signal.signal(signal.SIGTERM, _terminate)  # what `gptoss` installs in main()
    try:
        result = CliRunner().invoke(app, ["convert", str(tiny_hf), str(tmp_path / "mg"), "--to", "megatron", "-q"])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not isinstance(result.exception, RuntimeError), result.exception
    assert_one_line((result.exit_code, result.output), code, needle, prefix=prefix)
    assert list(tmp_path.iterdir()) == []
