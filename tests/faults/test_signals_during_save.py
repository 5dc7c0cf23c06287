"""Ctrl-C and SIGTERM that arrive while DCP writes a checkpoint: DCP wraps them into its own exception, but
they still end the run as an interruption (exit 130 / 143, 'interrupted' / 'terminated'), never as a failed
save; the partial folder is removed and `latest` stays on the last complete checkpoint."""

from __future__ import annotations

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
