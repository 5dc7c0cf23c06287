"""FP8 numerics for the experts' grouped linear layer: the gemm object behind `model.grouped_gemm`.

Rows of x are sorted by local expert, `tokens_per_expert` rows each; expert e's GEMMs are those of a
dense layer (gptoss_cli/fp8/linear.py) on its own rows and `W_e`:

    fprop  y_e  = x_e @ W_e^T      dgrad  dx_e = dy_e @ W_e      wgrad  dW_e = dy_e^T @ x_e

each an FP8 GEMM of its own (gptoss_cli/fp8/matmul.py): operands quantised along that GEMM's
contraction axis, tensorwise scales per expert operand, fp32 accumulation, one rounding to the
activation dtype.

With MXFP8 each expert's token group is padded with zero rows to a multiple of 32
(docs/megatron-rules.md, "Token dispatcher and expert data parallel") where a block runs along the
token axis: in wgrad, whose contraction axis it is, and which `Fp8Numerics.matmul` pads with zeros
like any contraction axis, per expert, so a block never straddles two experts. fprop and dgrad
quantise along the features and never block the token rows, so they need no padding. Biases are
added and reduced by `grouped_linear` outside the gemm, on the real rows only: a padding row never
receives a bias (docs/megatron-rules.md, "FP8 and MXFP8": a peer's NaN at EP > 1 came from biases
on padding rows).

Kernels: where the GPU has torch's grouped FP8 kernel and the GEMM fits it (fp8/grouped_kernel.py:
CUDA sm90/sm100, tensorwise or rowwise, e4m3 on both sides, bf16 activations), each of the three
GEMMs is one `torch._scaled_grouped_mm` over all experts, with the counts kept on the device: no
host read. Otherwise (the CPU emulation, MXFP8, `hybrid`'s e5m2 gradients, fp32 activations) a
loop of one FP8 GEMM per expert, which reads the counts to the host once per GEMM. Both quantise
every expert's operands alike; their NaN/inf checks go where the gemms' `checks` say (at once, one
host read per grouped GEMM; or the training step's device flag, fp8/guard.py). `stats` counts
expert GEMMs: the loop's non-empty experts, or every group of a grouped kernel call.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from gptoss_cli.fp8 import grouped_kernel
from gptoss_cli.fp8.linear import Fp8GemmBase
from gptoss_cli.fp8.matmul import SCALED_MM
from gptoss_cli.fp8.scaling import Fp8Format, check_all_finite, nonfinite_error
from gptoss_cli.model.gemm.grouped import GroupedGemm, expert_of_row, map_experts


def _nonempty(counts: list[int]) -> int:
    return sum(1 for c in counts if c)


class Fp8GroupedGemm(Fp8GemmBase, GroupedGemm):
    """fprop / dgrad / wgrad of one grouped expert layer (`layer` names it in errors)."""

    def fprop(self, x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:  # no rows: nothing to read or compute, on any path
            return x.new_zeros(0, weight.shape[1])
        f = self.numerics.forward
        if self.uses_grouped_kernel(x, f, f, x.shape[1], weight.shape[1], weight.shape[0]):
            return self._run_grouped(grouped_kernel.fprop, "fprop", x, weight, tokens_per_expert, self.numerics.forward)
        counts = tokens_per_expert.tolist()
        out = self._checked_once(lambda checks: map_experts(x, counts, lambda e, rows: self.numerics.matmul(
            rows, weight[e], grad_operand=None, where=f"{self.layer} (local expert {e}) fprop",
            names=("input", "weight"), out_dtype=x.dtype, checks=checks), weight.shape[1]))
        self.stats.count("fprop", _nonempty(counts))
        return out

    def dgrad(self, dy: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if dy.shape[0] == 0:
            return dy.new_zeros(0, weight.shape[2])
        g = self.numerics.gradient
        if self.uses_grouped_kernel(dy, g, self.numerics.forward, dy.shape[1], weight.shape[2], weight.shape[0]):
            return self._run_grouped(grouped_kernel.dgrad, "dgrad", dy, weight, tokens_per_expert, g)
        counts = tokens_per_expert.tolist()
        out = self._checked_once(lambda checks: map_experts(dy, counts, lambda e, rows: self.numerics.matmul(
            rows, weight[e].t(), grad_operand="a", where=f"{self.layer} (local expert {e}) dgrad",
            names=("output gradient", "weight"), out_dtype=dy.dtype, checks=checks), weight.shape[2]))
        self.stats.count("dgrad", _nonempty(counts))
        return out

    def wgrad(self, x: torch.Tensor, dy: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return dy.new_zeros(tokens_per_expert.numel(), dy.shape[1], x.shape[1])
        g = self.numerics.gradient
        if self.uses_grouped_kernel(x, g, self.numerics.forward, x.shape[1], dy.shape[1], tokens_per_expert.numel(),
                         out_dtype=dy.dtype):
            return self._run_grouped(grouped_kernel.wgrad, "wgrad", x, dy, tokens_per_expert, g)
        counts = tokens_per_expert.tolist()
        grads = self._checked_once(lambda checks: [
            self.numerics.matmul(d.t(), xe.t(), grad_operand="a", where=f"{self.layer} (local expert {e}) wgrad",
                                 names=("output gradient", "input"), out_dtype=dy.dtype, checks=checks)
            for e, (d, xe) in enumerate(zip(torch.split(dy, counts), torch.split(x, counts)))])
        self.stats.count("wgrad", _nonempty(counts))
        return torch.stack(grads) if grads else dy.new_zeros(0, dy.shape[1], x.shape[1])

    # --- the grouped kernel --------------------------------------------------------------------
    def uses_grouped_kernel(self, rows: torch.Tensor, fa: Fp8Format, fb: Fp8Format, k: int, n: int, groups: int,
                 out_dtype: torch.dtype | None = None) -> bool:
        """Whether this GEMM runs as one grouped kernel call (else the per-expert loop)."""
        return (self.numerics.kernel == SCALED_MM and grouped_kernel.available(rows.device)
                and grouped_kernel.supports(self.numerics.scaling, fa, fb, k, n, out_dtype or rows.dtype, groups))

    def _run_grouped(self, gemm: Callable, kind: str, a: torch.Tensor, b: torch.Tensor, tokens_per_expert: torch.Tensor,
                     fmt: Fp8Format) -> torch.Tensor:
        rows = expert_of_row(tokens_per_expert, a.shape[0])
        out, peaks = gemm(a, b, tokens_per_expert, rows, fmt, self.numerics.scaling == "tensor")
        where = f"{self.layer} (local expert {{expert}}) {kind}"
        deferred = self._deferred()
        if deferred is not None:
            for peak, operand in peaks:
                deferred.record(peak, f"{where} {operand}")
        else:  # at once: one host read for the whole grouped GEMM, the first expert (and operand) named
            values = torch.stack([p for p, _ in peaks], dim=1).tolist()
            for expert, row in enumerate(values):
                for value, (_, operand) in zip(row, peaks):
                    if not math.isfinite(value):
                        raise nonfinite_error(f"{where} {operand}".replace("{expert}", str(expert)), value)
        self.stats.count(kind, tokens_per_expert.numel())
        return out

    def _checked_once(self, run: Callable[[list], torch.Tensor | list]):
        """run(checks) with every expert's NaN/inf check collected and run after the loop: one host
        synchronisation per grouped GEMM instead of two per expert (or none: recorded for the step's
        flag when the checks are deferred). A failure inside the loop (a kernel error) first reports
        a non-finite operand of an earlier expert, as checking at once would."""
        deferred = self._deferred()
        if deferred is not None:
            return run(deferred)
        checks: list = []
        try:
            out = run(checks)
        except Exception:
            check_all_finite(checks)
            raise
        check_all_finite(checks)
        return out


__all__ = ["Fp8GroupedGemm"]
