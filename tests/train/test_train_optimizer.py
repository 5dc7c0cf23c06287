"""AdamW with fp32 master weights, global-norm clipping, non-finite guards and the warmup + cosine schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gptoss_cli.errors import TrainingError
from gptoss_cli.parallel.grads import GradAccumulatingModel
from gptoss_cli.parallel.state import ParallelState
from gptoss_cli.train.optimizer import DistributedAdamW, WarmupCosineLR, partition_contiguous


class Linear(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4, dtype=dtype))

    def forward(self, x):
        return (self.weight * x).sum()


def _model(dtype=torch.float32) -> GradAccumulatingModel:
    return GradAccumulatingModel(Linear(dtype), ParallelState())


def test_bf16_parameters_keep_fp32_master_weights():
    model = _model(torch.bfloat16)
    opt = DistributedAdamW(model, ParallelState(), lr=1e-4, weight_decay=0.0)
    for _ in range(5):
        model.zero_grad_buffer()
        model(torch.ones(()).to(torch.bfloat16)).backward()
        opt.step(1e-4)
    master = opt.master["weight"]
    assert master.dtype == torch.float32
    assert float(master[0, 0]) == pytest.approx(1.0 - 5e-4, abs=1e-6)  # 5 Adam steps of lr each
    assert torch.equal(model.module.weight, master.to(torch.bfloat16))  # bf16 cannot hold 0.9995: still 1.0
    assert float(model.module.weight[0, 0]) == 1.0


def test_gradients_are_clipped_to_the_global_norm():
    model = _model()
    opt = DistributedAdamW(model, ParallelState(), lr=1e-3, clip_grad=0.5)
    model(torch.full((), 10.0)).backward()
    assert opt.step(1e-3) == pytest.approx(40.0)  # ||10 * ones(4,4)|| = 40
    assert float(model.module.weight.main_grad.norm()) == pytest.approx(0.5, rel=1e-5)


def test_non_finite_gradient_norm_stops_before_the_update():
    model = _model()
    opt = DistributedAdamW(model, ParallelState(), lr=1e-3)
    model(torch.full((), float("inf"))).backward()
    with pytest.raises(TrainingError, match="gradient norm is"):
        opt.step(1e-3)
    assert torch.equal(model.module.weight, torch.ones(4, 4))


def test_warmup_then_cosine_to_min_lr():
    s = WarmupCosineLR(lr=1.0, min_lr=0.1, warmup_iters=4, decay_iters=14)
    assert [s.lr_at(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.lr_at(4) == pytest.approx(1.0)
    assert s.lr_at(9) == pytest.approx(0.55)  # half way through the decay
    assert s.lr_at(14) == pytest.approx(0.1) and s.lr_at(100) == pytest.approx(0.1)
    assert s.lr_at(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))


def test_optimizer_shards_are_contiguous_and_balanced():
    owners = partition_contiguous([10, 10, 10, 10, 40], 2)
    assert owners == [0, 0, 0, 0, 1]
    assert partition_contiguous([1] * 8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert owners == sorted(owners)
