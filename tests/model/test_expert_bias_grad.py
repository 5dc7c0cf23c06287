"""The experts' bias gradient on the device path (model/gemm/grouped.py, `_bias_grad`) against fp64.

On a GPU the counts stay on the device, so the per-expert column sums of the CPU path are not
available; the bias gradient used to be an `index_add_` in bf16 there, which a GPU runs as atomics
that round to bf16 after every add, in no fixed order. Emulated here in row order (one possible
order), that error grows with the rows per expert; the replacement sums in fp32 and rounds once.
The device path runs on the CPU with model/host_reads.py's `free` switched off, as tests/schedule/workers.py does.

Error model (tests/tolerances.py): the fp32 sum of n bf16 values is within n 2^-24 sum|dy| of the
exact sum, and rounding it once to bf16 (8 significant bits) adds at most 2^-8 of its magnitude.
"""

from __future__ import annotations

import torch

from gptoss_cli.model import host_reads
from gptoss_cli.model.gemm import grouped as grouped_gemm

COUNTS = [512, 256, 0, 768]  # an expert without rows gets a zero gradient


def _bf16_atomic_sums(dy: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """What `zeros(bf16).index_add_(0, expert_of_row, dy)` computes with bf16 atomics: each add rounded."""
    out = []
    for rows in torch.split(dy, counts):
        acc = torch.zeros(dy.shape[1], dtype=torch.bfloat16)
        for row in rows:
            acc = (acc.float() + row.float()).bfloat16()
        out.append(acc)
    return torch.stack(out)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def test_device_path_bias_gradient_is_the_fp32_sum_rounded_once(monkeypatch):
    monkeypatch.setattr(host_reads, "free", lambda device: False)
    g = torch.Generator().manual_seed(0)
    n = sum(COUNTS)
    # gradients with a common offset, as a bias gradient has: the sum grows with the rows
    dy = (torch.randn(n, 96, generator=g) + 0.3).bfloat16()
    owner = torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))
    exact = torch.zeros(len(COUNTS), 96, dtype=torch.float64).index_add_(0, owner, dy.double())

    got = grouped_gemm._bias_grad(dy, torch.tensor(COUNTS))
    assert got.dtype == torch.bfloat16 and torch.equal(got[2], torch.zeros(96, dtype=torch.bfloat16))
    abs_sum = torch.zeros_like(exact).index_add_(0, owner, dy.double().abs())
    bound = 2.0**-8 * exact.abs() + max(COUNTS) * 2.0**-24 * abs_sum
    assert torch.all((got.double() - exact).abs() <= bound)

    old = _bf16_atomic_sums(dy, COUNTS)
    # the old path's error at these counts: 15x the new one (6.9x at 128 rows, 130x at 2048)
    assert _rel(old, exact) > 10 * _rel(got, exact), (_rel(old, exact), _rel(got, exact))


def test_device_and_host_paths_agree(monkeypatch):
    # Both are fp32 sums rounded once: equal up to the order of the fp32 additions.
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(sum(COUNTS), 40, generator=g).bfloat16()
    counts = torch.tensor(COUNTS)
    host = grouped_gemm._bias_grad(dy, counts)
    monkeypatch.setattr(host_reads, "free", lambda device: False)
    device = grouped_gemm._bias_grad(dy, counts)
    assert ((host.double() - device.double()).abs() <= 2.0**-8 * host.double().abs() + 1e-6).all()
