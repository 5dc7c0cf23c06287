"""The FP8 NaN/inf check deferred to one device flag per step (fp8/guard.py): nothing read until the step's end, then the same error as the immediate check."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.errors import TrainingError
from gptoss_cli.fp8.selection import Fp8Settings, select_gemms
from gptoss_cli.model.gemm.dense import linear
from gptoss_cli.model.gemm.grouped import grouped_linear
from gptoss_cli.run.worker import run_worker
from tests.schedule.host_syncs import HostSyncCounter
from tests.train.workers import tiny_plan

COUNTS = [5, 0, 37, 32]


def _gemms(recipe: str = "rowwise"):
    gemms = select_gemms(Fp8Settings(recipe, "e4m3", emulation=True), "cpu")
    gemms.guard.deferred = True
    return gemms


def test_deferred_checks_read_nothing_and_name_the_first_bad_operand_after_the_step():
    gemms = _gemms()
    counts = torch.tensor(COUNTS)
    n = sum(COUNTS)
    x = torch.randn(n, 64, requires_grad=True)
    w = torch.randn(4, 96, 64, requires_grad=True)
    b = torch.zeros(4, 96, requires_grad=True)
    dy = torch.randn(n, 96)
    dy[COUNTS[0] + 3, 5] = float("inf")  # expert 2's output gradient: found in dgrad (the loop's order)
    counter = HostSyncCounter()
    with counter:
        y = linear(torch.randn(n, 64), torch.randn(64, 64), None, gemm=gemms.dense("layers.0.linear_qkv"))
        grouped_linear(x + y, w, b, counts, gemm=gemms.grouped("layers.1.mlp.experts.linear_fc1")).backward(dy)
        flag = gemms.guard.flag(torch.device("cpu"))
    # no amax read (on the CPU the per-expert loop reads its counts, once per GEMM: tests/schedule/test_step_syncs.py)
    checks = {s: k for s, k in counter.sites.items() if "fp8/scaling.py" in s or "fp8/guard.py" in s}
    assert checks == {}, counter.sites
    assert not torch.isfinite(flag)
    with pytest.raises(TrainingError, match=r"layers.1.mlp.experts.linear_fc1 \(local expert 2\) dgrad output gradient "
                                            r"contains inf.*checked once after the forward and backward, before"):
        gemms.guard.check(flag.item())
    assert len(gemms.guard) == 0  # cleared for the next step


def test_a_finite_step_clears_the_record():
    gemms = _gemms("tensorwise")
    linear(torch.randn(4, 64), torch.randn(32, 64), None, gemm=gemms.dense("layers.0.linear_proj"))
    assert len(gemms.guard) == 2  # input and weight of one fprop
    flag = gemms.guard.flag(torch.device("cpu"))
    assert flag.dtype == torch.float64 and torch.isfinite(flag)
    gemms.guard.check(flag.item())
    assert len(gemms.guard) == 0


def test_a_run_whose_values_overflow_stops_on_the_fp8_flag_before_the_optimizer_step(tmp_path):
    # fp16 with an absurd learning rate overflows on the second step; the FP8 flag, read with the
    # step's totals, names the first operand (in the order the step ran them) that held it.
    plan = tiny_plan(str(tmp_path / "r"), params_dtype="fp16", lr=1e4, min_lr=1e4, warmup_iters=0, clip_grad=0.0,
                     train_iters=4, aux_loss_coeff=0.0, seq_length=8, micro_batch_size=2, global_batch_size=2,
                     fp8_recipe="rowwise", fp8_format="e4m3", fp8_emulation=True)
    with pytest.raises(TrainingError, match=r"^decoder\.layers\.\d+\.\S+ (fprop|dgrad|wgrad) \S.* contains (NaN|inf).*"
                                            r"checked once after the forward and backward at step 2, before the optimizer step"):
        run_worker(plan)
