"""The overlap schedule's optional observer: what the bench installs sees every all-to-all and the
delayed wgrad work, changes nothing in the results, and without one nothing reads the clock."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from bench.overlap import OverlapStats
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.schedule.combined_1f1b import forward_backward_combined_1f1b
from gptoss_cli.train.data import DataLoaderState
from gptoss_cli.train.objective import forward_step
from tests.schedule.workers import SEQ, TINY, build
from tests.train.dist_helpers import named_grads
from tests.train.workers import RandomTokens

MICROBATCHES = 3
MOE_LAYERS = (1, 3, 5)  # "*E*E*E"
PACKAGE = Path(__import__("gptoss_cli").__file__).resolve().parent


def _step(observer=None):
    setup = build(ParallelState(), overlap=True, pattern="*E*E*E")
    data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ, seed=5), global_batch_size=2 * MICROBATCHES,
                           micro_batch_size=2, dp_rank=0, dp_size=1)
    setup.model.zero_grad_buffer()
    logs = forward_backward_combined_1f1b(forward_step_func=forward_step, data_iterator=data.step_iterator(),
                                          model=setup.model, num_microbatches=MICROBATCHES, observer=observer)
    return [float(l["loss_sum"]) for l in logs], named_grads(setup.model)


def test_observer_sees_every_all_to_all_and_the_delayed_wgrad_and_changes_nothing():
    stats = OverlapStats()
    losses, grads = _step(stats)
    # every comm node (dispatch and combine of each MoE layer), forward and backward, every microbatch
    names = [name for name, _, _ in stats.comms]
    expected = {f"decoder.layers.{j}.{node}" for j in MOE_LAYERS for node in ("dispatch", "combine")}
    assert set(names) == expected and len(names) == 2 * len(expected) * MICROBATCHES
    assert all(0 <= blocked <= in_flight for _, in_flight, blocked in stats.comms)
    # one queued dW per expert GEMM (fc1 and fc2) of every MoE layer and microbatch
    assert stats.wgrad_gemms == 2 * len(MOE_LAYERS) * MICROBATCHES
    plain_losses, plain_grads = _step(None)
    assert losses == plain_losses
    assert grads.keys() == plain_grads.keys()
    assert all(torch.equal(grads[k], plain_grads[k]) for k in grads)


def test_without_an_observer_the_plan_and_schedule_never_read_the_clock(monkeypatch):
    readers: list[str] = []
    for name in ("perf_counter", "perf_counter_ns", "monotonic", "time", "thread_time", "process_time"):
        real = getattr(time, name)

        def clock(*a, _real=real):
            readers.append(sys._getframe(1).f_code.co_filename)
            return _real(*a)

        monkeypatch.setattr(time, name, clock)
    _step(OverlapStats())  # the control: the hook sees the observer's clock reads
    assert any(Path(f).name == "overlap.py" and Path(f).parent.name == "bench" for f in readers)
    readers.clear()
    _step(None)
    assert {f for f in readers if _timing_free(f)} == set()


def _timing_free(filename: str) -> bool:
    """The files that read no clock without an observer: the dispatcher, the plan, the schedules."""
    path = Path(filename).resolve()
    return path.parent == PACKAGE / "schedule" or path in (PACKAGE / "model" / "dispatcher.py",
                                                           PACKAGE / "model" / "schedule_plan.py")
