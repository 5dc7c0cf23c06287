"""Host synchronisations of a bf16 FP8 training step on the path a GPU takes, counted on the CPU (tests/schedule/host_syncs.py).

Budget, per step at steady state (after one warm-up step), for the forward, backward and gradient
finalisation through the schedule, without expert parallelism:
  - zero in the model, the FP8 gemms and the schedules: the grouped GEMMs take their counts as a
    device tensor, the expert bias gradient is a GEMM, and every FP8 operand's NaN/inf check is
    recorded on the device (fp8/guard.py) instead of read;
  - the training loop then reads once for the step's totals, the FP8 flag riding on that read (not
    counted here: train/loop.py), and once for the gradient norm (optimizer.step, counted: 1).
With expert parallelism add one per MoE layer and microbatch, the token all-to-all's split sizes
(tests/schedule/test_comm_costs.py).

The CUDA-only branches are forced onto the CPU: the expert counts stay "on the device"
(model/host_reads.py's `free` off) and the grouped FP8 kernel is "available", its one CUDA call replaced by a
CPU stand-in that checks torch's contract (tests/fp8/scaled_grouped_reference.py, not counted: it
reads its offsets, as the CUDA kernel does on the device). What the counter cannot see is listed
in tests/schedule/host_syncs.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from gptoss_cli.fp8 import grouped_kernel
from gptoss_cli.model import host_reads
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.schedule import get_forward_backward_func
from gptoss_cli.train.data import DataLoaderState
from gptoss_cli.train.objective import forward_step
from gptoss_cli.train.provider import HybridModelProvider
from gptoss_cli.train.setup import setup_model_and_optimizer
from tests.fp8.scaled_grouped_reference import scaled_grouped_mm
from tests.schedule.host_syncs import HostSyncCounter
from tests.schedule.workers import SEQ, TINY
from tests.train.jobs import optimizer_config, runtime_config
from tests.train.workers import RandomTokens

MICROBATCHES = 2
MOE_LAYERS = TINY.num_hidden_layers  # "*E*E*E"
GEMM_FILES = ("fp8/grouped.py", "fp8/grouped_kernel.py", "fp8/linear.py", "fp8/matmul.py", "fp8/scaling.py",
              "fp8/guard.py", "model/gemm/grouped.py", "model/dispatcher.py", "model/moe.py", "model/loss.py",
              "model/gemm/main_grad.py", "schedule/plain.py", "schedule/combined_1f1b.py")


def _report(sites: dict[str, int]) -> str:
    return "\n".join(f"  {n} x {site}" for site, n in sorted(sites.items()))


def _in(sites: dict[str, int], files: tuple[str, ...]) -> int:
    return sum(n for site, n in sites.items() if site.split(":")[0].endswith(files))


def _count_step(monkeypatch, fp8_format: str, recipe: str = "rowwise", deferred: bool = True):
    """(sites of one counted step through the schedule, sites of its optimizer step)."""
    counter: list[HostSyncCounter] = [HostSyncCounter()]

    def stand_in(*args):
        with counter[0].suspended():
            return scaled_grouped_mm(*args[:4], offs=args[4])

    monkeypatch.setattr(host_reads, "free", lambda device: False)
    monkeypatch.setattr(grouped_kernel, "available", lambda device: True)
    monkeypatch.setattr(grouped_kernel, "run", stand_in)
    runtime = runtime_config(pattern="*E*E*E", params_dtype="bf16", aux_loss_coeff=0.01, fp8_recipe=recipe,
                             fp8_format=fp8_format, fp8_emulation=True)
    setup = setup_model_and_optimizer(HybridModelProvider(runtime, seed=7), ParallelState(),
                                      optimizer_config(clip_grad=1.0), 3e-3)
    fp8 = setup.config.fp8_gemms
    fp8.guard.deferred = deferred
    data = DataLoaderState(RandomTokens(TINY.vocab_size, SEQ, seed=5), global_batch_size=2 * MICROBATCHES,
                           micro_batch_size=2, dp_rank=0, dp_size=1)
    schedule = get_forward_backward_func(setup.config)
    for counted in (False, True):
        counter[0] = HostSyncCounter()
        setup.model.zero_grad_buffer()
        with counter[0] if counted else contextlib.nullcontext():
            schedule(forward_step_func=forward_step, data_iterator=data.step_iterator(), model=setup.model,
                     num_microbatches=MICROBATCHES)
            flag = fp8.guard.flag(torch.device("cpu"))  # the loop reads it with the step's totals
        fp8.guard.check(flag.item())
    step = HostSyncCounter()
    with step:
        setup.optimizer.step(3e-3)
    return dict(counter[0].sites), dict(step.sites), fp8


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_step_on_the_device_path_never_syncs_in_the_model_gemms_or_schedule(monkeypatch, recipe):
    sites, optimizer, fp8 = _count_step(monkeypatch, "e4m3", recipe)
    assert _in(sites, GEMM_FILES) == 0, _report(sites)
    assert sum(sites.values()) == 0, _report(sites)
    assert sum(optimizer.values()) <= 1, _report(optimizer)  # the gradient norm
    # the grouped kernel ran: one call per expert layer's fprop, dgrad, wgrad (4 experts each)
    assert fp8.stats.gemms["wgrad"] >= 2 * MOE_LAYERS * MICROBATCHES * TINY.num_local_experts


def test_the_counter_sees_the_per_expert_loop_and_immediate_nan_checks(monkeypatch):
    # hybrid's e5m2 output gradients do not fit the grouped kernel: dgrad and wgrad of fc1 and fc2
    # loop over the experts and read the counts, once per GEMM; checked at once (not deferred),
    # every quantised operand's amax is read too. The hook must see both, or it proves nothing.
    sites, _, _ = _count_step(monkeypatch, "hybrid", deferred=False)
    assert _in(sites, ("fp8/grouped.py",)) >= 4 * MOE_LAYERS * MICROBATCHES, _report(sites)
    assert _in(sites, ("fp8/scaling.py",)) > 0, _report(sites)
