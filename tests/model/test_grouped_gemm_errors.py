"""A `torch._grouped_mm` failure stops the run naming the GEMM, every time: never a silent switch of the rest of the run to the per-expert loop (model/gemm/grouped.py)."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.errors import TrainingError
from gptoss_cli.model.gemm.grouped import GroupedGemm


def test_a_grouped_kernel_error_is_a_training_error_each_time_not_a_demotion(monkeypatch):
    calls = []

    def failing(a, b, offs=None):
        calls.append(a.shape)
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    monkeypatch.setattr(torch, "_grouped_mm", failing)
    x, w, counts = torch.randn(10, 64), torch.randn(3, 32, 64), torch.tensor([3, 0, 7])
    for _ in range(2):  # the second call tries the kernel again: nothing was demoted
        with pytest.raises(TrainingError, match=r"^torch._grouped_mm failed for the experts' fprop GEMM "
                                                r"\(\[10, 64\] x \[3, 64, 32\], float32, cpu\): CUDA error: an illegal"):
            GroupedGemm().fprop(x, w, counts)
    assert len(calls) == 2


def test_out_of_memory_passes_through_unchanged(monkeypatch):
    def oom(a, b, offs=None):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "_grouped_mm", oom)
    with pytest.raises(torch.OutOfMemoryError):
        GroupedGemm().dgrad(torch.randn(10, 32), torch.randn(3, 32, 64), torch.tensor([3, 0, 7]))
