"""FP8 numerics for the experts' grouped linear layer: the gemm object behind `model.grouped_gemm`.

Rows of x are sorted by local expert, `tokens_per_expert` rows each; expert e's GEMMs are those of a
dense layer (gptoss_cli/fp8/linear.py) on its own rows and `W_e`:

    fprop  y_e  = x_e @ W_e^T      dgrad  dx_e = dy_e @ W_e      wgrad  dW_e = dy_e^T @ x_e

each an FP8 GEMM of its own (gptoss_cli/fp8/matmul.py): operands quantised along that GEMM's
contraction axis, tensorwise scales per expert operand, fp32 accumulation, one rounding to the
activation dtype.

MXFP8 pads every expert's token group with zero rows to a multiple of 32 before its GEMMs
(docs/megatron-rules.md, "Token dispatcher and expert data parallel"), so the weight gradient's
blocks along the token axis never straddle two experts, and removes the padding from the GEMM
outputs before they leave the gemm. Biases are added and reduced by `grouped_linear` outside the
gemm, on the real rows only: a padding row never receives a bias (docs/megatron-rules.md,
"FP8 and MXFP8": a peer's NaN at EP > 1 came from biases on padding rows).
"""

from __future__ import annotations

import torch

from gptoss_cli.fp8.linear import Fp8Stats
from gptoss_cli.fp8.matmul import Fp8Numerics
from gptoss_cli.fp8.scaling import MX_BLOCK
from gptoss_cli.model.grouped_gemm import GroupedGemm


def pad_groups(rows: torch.Tensor, counts: list[int], multiple: int) -> tuple[torch.Tensor, list[int]]:
    """Rows grouped by `counts` -> each group followed by zero rows up to a multiple of `multiple`."""
    padded = [c + (-c) % multiple for c in counts]
    if padded == counts:
        return rows, counts
    pieces = []
    for chunk, c, p in zip(torch.split(rows, counts), counts, padded):
        pieces.append(chunk)
        if p > c:
            pieces.append(rows.new_zeros(p - c, rows.shape[1]))
    return torch.cat(pieces), padded


def unpad_groups(rows: torch.Tensor, counts: list[int], padded: list[int]) -> torch.Tensor:
    """Inverse of `pad_groups`: the first counts[e] rows of every padded group."""
    if padded == counts:
        return rows
    return torch.cat([chunk[:c] for chunk, c in zip(torch.split(rows, padded), counts)])


def _nonempty(counts: list[int]) -> int:
    return sum(1 for c in counts if c)


class Fp8GroupedGemm(GroupedGemm):
    """fprop / dgrad / wgrad of one grouped expert layer (`layer` names it in errors)."""

    name = "fp8"

    def __init__(self, numerics: Fp8Numerics, layer: str, stats: Fp8Stats | None = None):
        self.numerics = numerics
        self.layer = layer
        self.stats = stats if stats is not None else Fp8Stats()
        self.group_multiple = MX_BLOCK if numerics.scaling == "mx" else 1

    def __repr__(self) -> str:
        return f"Fp8GroupedGemm({self.layer!r}, {self.numerics.scaling}, {self.numerics.kernel})"

    def _groups(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        counts = tokens_per_expert.tolist()
        padded_rows, padded = pad_groups(rows, counts, self.group_multiple)
        return padded_rows, counts, padded

    def fprop(self, x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        xp, counts, padded = self._groups(x, tokens_per_expert)
        outs = [self.numerics.matmul(chunk, weight[e], grad_operand=None, where=f"{self.layer} (local expert {e}) fprop",
                                     names=("input", "weight"), out_dtype=x.dtype)
                for e, chunk in enumerate(torch.split(xp, padded))]
        self.stats.count("fprop", _nonempty(counts))
        out = torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])
        return unpad_groups(out, counts, padded)

    def dgrad(self, dy: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        dyp, counts, padded = self._groups(dy, tokens_per_expert)
        outs = [self.numerics.matmul(chunk, weight[e].t(), grad_operand="a",
                                     where=f"{self.layer} (local expert {e}) dgrad",
                                     names=("output gradient", "weight"), out_dtype=dy.dtype)
                for e, chunk in enumerate(torch.split(dyp, padded))]
        self.stats.count("dgrad", _nonempty(counts))
        out = torch.cat(outs) if outs else dy.new_zeros(0, weight.shape[2])
        return unpad_groups(out, counts, padded)

    def wgrad(self, x: torch.Tensor, dy: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        xp, counts, padded = self._groups(x, tokens_per_expert)
        dyp, _, _ = self._groups(dy, tokens_per_expert)
        grads = [self.numerics.matmul(d.t(), xe.t(), grad_operand="a", where=f"{self.layer} (local expert {e}) wgrad",
                                      names=("output gradient", "input"), out_dtype=dy.dtype)
                 for e, (d, xe) in enumerate(zip(torch.split(dyp, padded), torch.split(xp, padded)))]
        self.stats.count("wgrad", _nonempty(counts))
        return torch.stack(grads) if grads else dy.new_zeros(0, dy.shape[1], x.shape[1])


__all__ = ["Fp8GroupedGemm", "pad_groups", "unpad_groups"]
