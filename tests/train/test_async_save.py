"""checkpoint.async_save and checkpoint.save_on_signal in the loop (issues 55 and 53).

The reference for what an asynchronous checkpoint holds is the synchronous save of the same run: DCP's own
`dcp.save` on the state the step left, read back tensor by tensor with DCP's reader. On the CPU one process
computes the same steps bit for bit, so the two must be equal exactly (no tolerance). The upload is held
(`upload_gate`) until the step after the save has run its optimizer step: a stager that did not copy would
then write the later state, which is the bug the comparison is for.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from gptoss_cli.errors import Terminated
from gptoss_cli.run.worker import run_worker
from gptoss_cli.train.progress import CheckpointSaved, StepDone
from tests.train.dist_helpers import once_per_session, run_distributed
from tests.train.test_train_checkpoint import Killed, _load_all
from tests.train.workers import ep2_checkpoint_run, run_plan_worker, tiny_plan


class UploadGate:
    """Holds the upload of step k's checkpoint until step k + 1 has finished (or k is the last step), so the
    training thread has changed the state by the time the upload reads its copy."""

    def __init__(self, last: int):
        self.last, self.done, self.cond = last, 0, threading.Condition()

    def progress(self, event: Any) -> None:
        if isinstance(event, StepDone):
            with self.cond:
                self.done = event.step
                self.cond.notify_all()

    def install(self, monkeypatch) -> None:
        import torch.distributed.checkpoint.state_dict_saver as saver

        real = saver.save

        def held_save(state_dict, *, checkpoint_id=None, **kw):
            step = int(Path(checkpoint_id).name.split("_")[1].split(".")[0])
            with self.cond:
                assert self.cond.wait_for(lambda: self.done > step or step == self.last, timeout=120), step
            return real(state_dict, checkpoint_id=checkpoint_id, **kw)

        monkeypatch.setattr(saver, "save", held_save)  # what DCP's upload thread calls


def _tensors_equal(a: Path, b: Path) -> None:
    left, right = _load_all(a), _load_all(b)
    assert sorted(left) == sorted(right)
    for name in left:
        assert torch.equal(left[name], right[name]), name


def _train_state(folder: Path) -> dict:
    """train_state.json but the run record (which names the run folder, another one per run here)."""
    return {k: v for k, v in json.loads((folder / "train_state.json").read_text()).items() if k != "run"}


def test_an_async_checkpoint_holds_the_state_of_its_step_while_the_next_steps_run(tmp_path, monkeypatch):
    sync = run_worker(tiny_plan(str(tmp_path / "a"), train_iters=4, save_interval=1,
                                checkpoint_dir=str(tmp_path / "sync")))
    gate = UploadGate(last=4)
    gate.install(monkeypatch)
    saved: list[int] = []

    def progress(event):
        gate.progress(event)
        if isinstance(event, CheckpointSaved):
            saved.append(event.step)

    result = run_worker(tiny_plan(str(tmp_path / "b"), train_iters=4, save_interval=1, async_save=True,
                                  checkpoint_dir=str(tmp_path / "async")), progress)
    assert result.losses == sync.losses and result.checkpoint.endswith("iter_0000004")
    assert saved == [1, 2, 3, 4]  # each announced once published, in order
    assert (tmp_path / "async" / "latest").read_text() == "iter_0000004\n"
    assert sorted(p.name for p in (tmp_path / "async").iterdir()) == sorted(p.name for p in (tmp_path / "sync").iterdir())
    for step in (1, 2, 3, 4):
        name = f"iter_{step:07d}"
        _tensors_equal(tmp_path / "async" / name, tmp_path / "sync" / name)
        assert _train_state(tmp_path / "async" / name) == _train_state(tmp_path / "sync" / name)


def test_a_run_stopped_with_a_save_in_flight_publishes_it_and_a_resume_continues_bitwise(tmp_path, monkeypatch):
    """An exception after step 5 with step 4's upload still held: the way out finishes and publishes it
    (`abandon`), retention keeps the last two, and the resume from step 4 gives the uninterrupted losses."""
    full = run_worker(tiny_plan(str(tmp_path / "full"), train_iters=7))
    gate = UploadGate(last=7)
    gate.install(monkeypatch)

    def progress(event):
        gate.progress(event)
        if isinstance(event, StepDone) and event.step == 5:
            raise Killed(5)

    ckpt = tmp_path / "ckpt"
    plan = dict(train_iters=7, save_interval=2, async_save=True, keep_last=2, checkpoint_dir=str(ckpt))
    with pytest.raises(Killed):
        run_worker(tiny_plan(str(tmp_path / "a"), **plan), progress)
    assert (ckpt / "latest").read_text() == "iter_0000004\n"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000004", "latest"]
    monkeypatch.undo()
    resumed = run_worker(tiny_plan(str(tmp_path / "b"), **plan))
    assert resumed.resumed_from.endswith("iter_0000004")
    assert resumed.losses == full.losses[4:] and resumed.grad_norms == full.grad_norms[4:]
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000006", "iter_0000007"]


# --- two processes (gloo) -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ep2_sync(tmp_path_factory):
    return once_per_session(tmp_path_factory, "ep2_checkpoint", ep2_checkpoint_run)[0]


def test_async_saves_at_ep2_on_two_processes_equal_the_synchronous_ones(ep2_sync, tmp_path):
    """The distributed optimizer's ShardedTensors staged and written on their own gloo group, on 2 ranks."""
    plan = tiny_plan(str(tmp_path / "run"), ep_size=2, train_iters=3, save_interval=2, async_save=True,
                     checkpoint_dir=str(tmp_path / "ckpt"))
    run_distributed(run_plan_worker, 2, tmp_path / "out", plan, preload=("gptoss_cli.run.worker",))
    assert (tmp_path / "ckpt" / "latest").read_text() == "iter_0000003\n"
    for name in ("iter_0000002", "iter_0000003"):
        _tensors_equal(tmp_path / "ckpt" / name, Path(ep2_sync) / "ckpt" / name)


def signal_one_rank_worker(rank: int, plan: Any, step: int, target: int) -> dict[str, Any]:
    """run_worker where rank `target` alone gets SIGTERM after logging step `step`; what each rank saw."""
    import gptoss_cli.train.loop as loop

    real = loop.Trainer.record_step
    steps: list[int] = []

    def record_step(self, out, extra=None):
        steps.append(out.step)
        fields = real(self, out, extra)
        if out.step == step and self.state.rank == target:
            os.kill(os.getpid(), signal.SIGTERM)  # through the handler save_on_signal installed
        return fields

    loop.Trainer.record_step = record_step
    try:
        run_worker(plan)
    except Terminated:
        return {"stopped": "terminated", "steps": steps}
    return {"stopped": None, "steps": steps}


def test_a_sigterm_that_reaches_one_rank_stops_both_after_the_same_step_saved(tmp_path):
    plan = tiny_plan(str(tmp_path / "run"), ep_size=2, train_iters=6, save_interval=4, async_save=True,
                     save_on_signal=True, checkpoint_dir=str(tmp_path / "ckpt"))
    out = run_distributed(signal_one_rank_worker, 2, tmp_path / "out", plan, 2, 1,
                          preload=("gptoss_cli.run.worker",))
    assert out == [{"stopped": "terminated", "steps": [1, 2]}] * 2
    assert (tmp_path / "ckpt" / "latest").read_text() == "iter_0000002\n"
    assert _train_state(tmp_path / "ckpt" / "iter_0000002")["saved_on"] == "signal"
