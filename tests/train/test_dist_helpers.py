"""The multi-process test harness fails a run whose worker raised or died, even if results exist."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.train.dist_helpers import _teardown_only, run_distributed


def dies_after_saving_its_result(rank: int, out_dir: str) -> int:
    """Rank 1 leaves a result file behind and is killed before the post-result barrier."""
    if rank == 1:
        torch.save(1, Path(out_dir) / "rank1.pt")
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def test_a_worker_that_dies_after_saving_a_result_fails_the_run(tmp_path):
    with pytest.raises(AssertionError, match="process 1 terminated with signal SIGKILL"):
        run_distributed(dies_after_saving_its_result, 2, tmp_path, str(tmp_path))


def _files(folder: Path, names: list[str]) -> Path:
    folder.mkdir()
    for n in names:
        (folder / n).touch()
    return folder


def _exited(rank: int, signal_name: str = "SIGABRT") -> Exception:
    return mp.ProcessExitedException(f"process {rank} terminated with signal {signal_name}", error_index=rank,
                                     error_pid=0, exit_code=-6, signal_name=signal_name)


def test_only_a_failure_after_the_result_barrier_counts_as_teardown(tmp_path):
    results = ["rank0.pt", "rank1.pt"]
    # rank 1 aborted after its .done marker (written after the barrier): teardown, tolerated
    assert _teardown_only(_exited(1), _files(tmp_path / "a", results + ["rank1.done"]), 2)
    # the same abort before the marker (every result present): a failure
    assert not _teardown_only(_exited(1), _files(tmp_path / "b", results + ["rank0.done"]), 2)
    # a Python exception raised before the marker
    raised = mp.ProcessRaisedException("ValueError", error_index=0, error_pid=0)
    assert not _teardown_only(raised, _files(tmp_path / "c", results + ["rank1.done"]), 2)
    # a hang: only if every rank is past the barrier
    assert _teardown_only(TimeoutError(), _files(tmp_path / "d", results + ["rank0.done", "rank1.done"]), 2)
    assert not _teardown_only(TimeoutError(), _files(tmp_path / "e", results + ["rank0.done"]), 2)
    # a missing result is never teardown
    assert not _teardown_only(_exited(1), _files(tmp_path / "f", ["rank0.pt", "rank1.done"]), 2)

