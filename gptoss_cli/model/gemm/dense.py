"""The dense linear layer's GEMM seam: forward, input gradient and weight gradient in one place.

For `x [..., in]`, `weight [out, in]`, `bias [out]` the three GEMMs are

    fprop  y  = x @ W^T          (+ b, added outside the GEMM)
    dgrad  dx = dy @ W
    wgrad  dW = dy^T @ x,  db = sum over the rows of dy

`DenseGemm` computes them in the operands' dtype; a low-precision recipe (gptoss_cli/fp8/)
provides the same three methods with other numerics and `linear(..., gemm=...)` runs them inside
one autograd function. Without a gemm, `linear` is `F.linear` (bitwise what the model computed
before the seam existed). The bias is added in the activation dtype outside the GEMM, like the
experts' (model/gemm/grouped.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


# The submodule name of a layer's adapter (model/lora.py attaches LoRA's there; checkpoint names
# `<layer>.adapter.linear_in.weight`).
ADAPTER = "adapter"


class DenseAdapter(Protocol):
    """What a dense layer adds to its output, computed from the layer's input (LoRA: model/lora.py's LoraAdapter)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def attached_adapter(layer: nn.Module) -> DenseAdapter | None:
    """The adapter attached to `layer` as its `adapter` submodule; None without one."""
    return dict(layer.named_children()).get(ADAPTER)


class DenseGemm:
    """The three GEMMs of a linear layer in the operands' own dtype (rows of 2-D tensors)."""

    name = "default"

    def fprop(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x @ weight.t()

    def dgrad(self, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return dy @ weight

    def wgrad(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        return dy.t() @ x


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemm: DenseGemm):
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(rows, weight)
        ctx.gemm, ctx.x_shape, ctx.has_bias = gemm, x.shape, bias is not None
        y = gemm.fprop(rows, weight)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        rows, weight = ctx.saved_tensors
        dy = dy.reshape(-1, dy.shape[-1]).contiguous()
        dx = ctx.gemm.dgrad(dy, weight).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        dw = ctx.gemm.wgrad(rows, dy).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           gemm: DenseGemm | None = None) -> torch.Tensor:
    """`x @ weight^T + bias` through `gemm`'s three GEMMs; `F.linear` when gemm is None."""
    if gemm is None:
        return F.linear(x, weight, bias)
    if not torch.is_grad_enabled():
        y = gemm.fprop(x.reshape(-1, x.shape[-1]), weight)
        y = y if bias is None else y + bias.to(y.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])
    return _Linear.apply(x, weight, bias, gemm)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and names) whose GEMMs can be swapped: set `.gemm`; an adapter
    (`adapter`, LoRA's) adds its output."""

    gemm: DenseGemm | None = None

    @property
    def adapter(self) -> DenseAdapter | None:
        return attached_adapter(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, gemm=self.gemm)
        adapter = self.adapter
        return y if adapter is None else y + adapter(x)


__all__ = ["ADAPTER", "DenseAdapter", "DenseGemm", "Linear", "attached_adapter", "linear"]
