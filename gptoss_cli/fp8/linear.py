"""FP8 numerics for a dense linear layer: the gemm object behind `model.dense_gemm.linear`.

For `y = x W^T` (x `[M, in]`, W `[out, in]`, dy `[M, out]`) each GEMM quantises its two operands
along its own contraction axis (gptoss_cli/fp8/matmul.py) and rounds its fp32 sum once to the
activation dtype:

    fprop  y  = x   @ W       contraction over in    x: e4m3,  W: e4m3
    dgrad  dx = dy  @ W       contraction over out   dy: gradient format, W^T: e4m3
    wgrad  dW = dy^T @ x      contraction over M     dy^T: gradient format, x^T: e4m3

(gradient format: e5m2 under `fp8_format=hybrid`, else e4m3). W is re-quantised along `out` for
dgrad and x along the tokens for wgrad: with MX these are other 32-blocks than the forward's, and
with rowwise other rows. For wgrad the token axis is padded with zero rows to whole blocks.
The bias is not the gemm's business: `linear` adds it in the activation dtype outside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gptoss_cli.fp8.matmul import Fp8Numerics


@dataclass
class Fp8Stats:
    """How many FP8 GEMMs ran, by GEMM kind (shared by every gemm of one model; the run reports it)."""

    gemms: dict[str, int] = field(default_factory=lambda: {"fprop": 0, "dgrad": 0, "wgrad": 0})

    def count(self, kind: str, n: int = 1) -> None:
        self.gemms[kind] += n

    @property
    def total(self) -> int:
        return sum(self.gemms.values())


class Fp8GemmBase:
    """What every FP8 GEMM seam holds: the numerics, the layer's name for errors, the GEMM counts."""

    name = "fp8"

    def __init__(self, numerics: Fp8Numerics, layer: str, stats: Fp8Stats | None = None, checks: Any = None):
        self.numerics = numerics
        self.layer = layer
        self.stats = stats if stats is not None else Fp8Stats()
        # Where the NaN/inf checks go (fp8/guard.py's NonFiniteGuard, shared by the model's gemms):
        # None or not deferred = each operand checked at once.
        self.checks = checks

    def _deferred(self) -> Any:
        """The checks object when checks are deferred to the step's flag, else None (check at once)."""
        return self.checks if self.checks is not None and getattr(self.checks, "deferred", False) else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layer!r}, {self.numerics.scaling}, {self.numerics.kernel})"


class Fp8LinearGemm(Fp8GemmBase):
    """fprop / dgrad / wgrad of one linear layer (`layer` names it in errors)."""

    def fprop(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.stats.count("fprop")
        return self.numerics.matmul(x, weight, grad_operand=None, where=f"{self.layer} fprop",
                                    names=("input", "weight"), out_dtype=x.dtype, checks=self._deferred())

    def dgrad(self, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.stats.count("dgrad")
        return self.numerics.matmul(dy, weight.t(), grad_operand="a", where=f"{self.layer} dgrad",
                                    names=("output gradient", "weight"), out_dtype=dy.dtype, checks=self._deferred())

    def wgrad(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        self.stats.count("wgrad")
        return self.numerics.matmul(dy.t(), x.t(), grad_operand="a", where=f"{self.layer} wgrad",
                                    names=("output gradient", "input"), out_dtype=dy.dtype, checks=self._deferred())


__all__ = ["Fp8GemmBase", "Fp8LinearGemm", "Fp8Stats"]
