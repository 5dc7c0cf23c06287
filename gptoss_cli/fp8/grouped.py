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
"""

from __future__ import annotations

import torch

from gptoss_cli.fp8.linear import Fp8GemmBase
from gptoss_cli.fp8.scaling import check_all_finite
from gptoss_cli.model.grouped_gemm import GroupedGemm, map_experts


def _nonempty(counts: list[int]) -> int:
    return sum(1 for c in counts if c)


def _checked_once(run):
    """run(checks) with every expert's NaN/inf check collected and run after the loop: one host
    synchronisation per grouped GEMM instead of two per expert. A failure inside the loop (a
    kernel error) first reports a non-finite operand of an earlier expert, as checking at once would."""
    checks: list = []
    try:
        out = run(checks)
    except Exception:
        check_all_finite(checks)
        raise
    check_all_finite(checks)
    return out


class Fp8GroupedGemm(Fp8GemmBase, GroupedGemm):
    """fprop / dgrad / wgrad of one grouped expert layer (`layer` names it in errors)."""

    def fprop(self, x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = tokens_per_expert.tolist()
        out = _checked_once(lambda checks: map_experts(x, counts, lambda e, rows: self.numerics.matmul(
            rows, weight[e], grad_operand=None, where=f"{self.layer} (local expert {e}) fprop",
            names=("input", "weight"), out_dtype=x.dtype, checks=checks), weight.shape[1]))
        self.stats.count("fprop", _nonempty(counts))
        return out

    def dgrad(self, dy: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = tokens_per_expert.tolist()
        out = _checked_once(lambda checks: map_experts(dy, counts, lambda e, rows: self.numerics.matmul(
            rows, weight[e].t(), grad_operand="a", where=f"{self.layer} (local expert {e}) dgrad",
            names=("output gradient", "weight"), out_dtype=dy.dtype, checks=checks), weight.shape[2]))
        self.stats.count("dgrad", _nonempty(counts))
        return out

    def wgrad(self, x: torch.Tensor, dy: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = tokens_per_expert.tolist()
        grads = _checked_once(lambda checks: [
            self.numerics.matmul(d.t(), xe.t(), grad_operand="a", where=f"{self.layer} (local expert {e}) wgrad",
                                 names=("output gradient", "input"), out_dtype=dy.dtype, checks=checks)
            for e, (d, xe) in enumerate(zip(torch.split(dy, counts), torch.split(x, counts)))])
        self.stats.count("wgrad", _nonempty(counts))
        return torch.stack(grads) if grads else dy.new_zeros(0, dy.shape[1], x.shape[1])

__all__ = ["Fp8GroupedGemm"]
