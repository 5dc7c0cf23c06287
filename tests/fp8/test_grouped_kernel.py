"""The experts' FP8 GEMMs as one `torch._scaled_grouped_mm` each (fp8/grouped_kernel.py) against the per-expert loop, bit for bit.

torch has no CPU kernel for `_scaled_grouped_mm`; its one call is replaced by a stand-in that
asserts the CUDA op's contract (layouts, strides, scale shapes, int32 offsets, 2d-2d group lengths)
and computes each group with the CPU `_scaled_mm` kernel the loop uses
(tests/fp8/scaled_grouped_reference.py). Equal bytes out means the grouped path quantised every
expert's operands exactly as the loop does and laid them out as the kernel reads them.

The two paths are the same computation: the same fp8 operands and scales, the same nonzero products
(the grouped wgrad only adds zero rows to reach whole groups of 16 tokens). What a CPU GEMM kernel would
make of them is not: torch's CPU `_scaled_mm` sums in fp32 in an order that depends on the CPU's kernel
and the contraction length (5 tokens in the loop, 16 padded in the grouped call), so on an AVX512 Xeon
the grouped wgrad differed from the loop in the last bf16 bit while both were right. Both paths' GEMMs
therefore run here through `exact_scaled_mm`, whose sum is exact in any order: equal bytes out are
then a property of the operands alone, on every machine.
"""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.errors import TrainingError
from gptoss_cli.fp8 import grouped_kernel
from gptoss_cli.fp8.scaling import E4M3, E5M2
from gptoss_cli.fp8.selection import Fp8Settings, select_gemms
from gptoss_cli.model.gemm.grouped import expert_of_row
from tests.fp8.scaled_grouped_reference import exact_scaled_mm, scaled_grouped_mm

COUNTS = [5, 0, 37, 32, 1]  # an expert without tokens, one of whole blocks of 16, odd counts


@pytest.fixture
def grouped_kernel_on(monkeypatch):
    calls = []

    def stand_in(a, b, scale_a, scale_b, offs):
        calls.append(b.dim())
        return scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs)

    monkeypatch.setattr(grouped_kernel, "available", lambda device: True)
    monkeypatch.setattr(grouped_kernel, "run", stand_in)
    # the loop's GEMMs and the stand-in's groups alike: a sum with no CPU-dependent rounding (module docstring)
    monkeypatch.setattr(torch, "_scaled_mm", exact_scaled_mm)
    return calls


def _operands(seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    n, e = sum(COUNTS), len(COUNTS)
    scales = torch.repeat_interleave(torch.tensor([1e-3, 1.0, 1e3, 1.0, 7.0]), torch.tensor(COUNTS))
    x = (torch.randn(n, 64, generator=g) * scales[:, None]).bfloat16()
    w = torch.randn(e, 96, 64, generator=g).bfloat16()
    dy = (torch.randn(n, 96, generator=g) * scales.flip(0)[:, None]).bfloat16()
    return x, w, dy, torch.tensor(COUNTS)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_grouped_kernel_equals_the_per_expert_loop_bit_for_bit(grouped_kernel_on, monkeypatch, recipe):
    gemm = select_gemms(Fp8Settings(recipe, "e4m3", emulation=True), "cpu").grouped("layers.1.mlp.experts.linear_fc1")
    x, w, dy, counts = _operands()
    grouped = (gemm.fprop(x, w, counts), gemm.dgrad(dy, w, counts), gemm.wgrad(x, dy, counts))
    assert grouped_kernel_on == [3, 3, 2]  # fprop and dgrad 2d x 3d, wgrad 2d x 2d: each one call
    monkeypatch.setattr(grouped_kernel, "available", lambda device: False)
    loop = (gemm.fprop(x, w, counts), gemm.dgrad(dy, w, counts), gemm.wgrad(x, dy, counts))
    for kind, a, b in zip(("fprop", "dgrad", "wgrad"), grouped, loop):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), kind


def test_what_the_grouped_kernel_does_not_take_keeps_the_loop():
    ok = dict(scaling="row", fa=E4M3, fb=E4M3, k=64, n=96, out_dtype=torch.bfloat16, groups=4)
    assert grouped_kernel.supports(**ok)
    for change in (dict(scaling="mx"), dict(fa=E5M2), dict(out_dtype=torch.float32), dict(k=72), dict(n=40),
                   dict(groups=1024)):
        assert not grouped_kernel.supports(**{**ok, **change}), change
    assert not grouped_kernel.available(torch.device("cpu"))


def test_wgrad_groups_are_padded_to_positive_multiples_of_16_without_reading_the_counts():
    counts = torch.tensor(COUNTS)
    dest, ends, rows = grouped_kernel.padded_rows(counts, expert_of_row(counts, sum(COUNTS)))
    assert ends.dtype == torch.int32 and ends.tolist() == [16, 32, 80, 112, 128]  # 5->16, 0->16, 37->48, 32, 1->16
    assert rows == 160 and rows >= ends[-1].item()  # N + 16 E = 155, rounded up to 16
    starts = [0, 16, 32, 80, 112]
    want = [starts[e] + i for e, c in enumerate(COUNTS) for i in range(c)]
    assert dest.tolist() == want


def test_a_non_finite_operand_names_the_expert_on_the_grouped_path(grouped_kernel_on):
    gemm = select_gemms(Fp8Settings("rowwise", "e4m3", emulation=True), "cpu").grouped("layers.1.mlp.experts.linear_fc2")
    x, w, dy, counts = _operands()
    w[1] = float("nan")  # expert 1 has no tokens: its weight is never read, no error
    assert torch.isfinite(gemm.fprop(x, w, counts).float()).all()
    x[COUNTS[0] + 2, 7] = float("inf")  # expert 2's input
    with pytest.raises(TrainingError, match=r"linear_fc2 \(local expert 2\) fprop input contains inf"):
        gemm.fprop(x, w, counts)
    dy[-1, 0] = float("nan")  # expert 4's output gradient
    with pytest.raises(TrainingError, match=r"linear_fc2 \(local expert 4\) dgrad output gradient contains NaN"):
        gemm.dgrad(dy, w, counts)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_a_rank_that_received_no_rows_reads_nothing_and_gets_zeros(grouped_kernel_on, fp8):
    # Under expert parallelism a rank can receive no tokens: no count is read, no kernel called.
    from gptoss_cli.model.gemm.grouped import DEFAULT_GEMM
    from tests.schedule.host_syncs import HostSyncCounter

    gemm = select_gemms(Fp8Settings("rowwise", "e4m3", emulation=True), "cpu").grouped("l") if fp8 else DEFAULT_GEMM
    x, dy, w = torch.zeros(0, 64).bfloat16(), torch.zeros(0, 96).bfloat16(), _operands()[1]
    counts = torch.zeros(5, dtype=torch.long)
    counter = HostSyncCounter()
    with counter:
        y, dx, dw = gemm.fprop(x, w, counts), gemm.dgrad(dy, w, counts), gemm.wgrad(x, dy, counts)
    assert counter.total == 0 and grouped_kernel_on == []
    assert (y.shape, dx.shape, dw.shape) == ((0, 96), (0, 64), (5, 96, 64)) and not dw.any()
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
