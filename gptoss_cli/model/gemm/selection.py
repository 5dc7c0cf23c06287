"""GEMM selection: which numerics each linear projection and each experts' grouped linear layer computes with."""

from __future__ import annotations

from typing import Callable

from torch import nn

from gptoss_cli.model.attention.layer import LayerNormLinear
from gptoss_cli.model.gemm.dense import DenseGemm, Linear
from gptoss_cli.model.gemm.grouped import GroupedGemm
from gptoss_cli.model.moe import ExpertLinear


def set_gemms(
    module: nn.Module,
    *,
    dense: Callable[[str], DenseGemm] | None = None,
    grouped: Callable[[str], GroupedGemm] | None = None,
) -> list[str]:
    """Choose the numerics of the transformer layers' GEMMs: `dense(name)` gives the gemm of each
    linear projection (attention's `linear_qkv` and `linear_proj`, a `-` layer's MLP),
    `grouped(name)` that of each experts' `linear_fc1` / `linear_fc2`; None restores the default.
    `name` is the layer's parameter prefix, which low-precision gemms use in their errors.

    The router, embeddings, output layer, norms and sinks keep the model's dtype (they are not
    these module types). Returns the names of the layers that got a gemm."""
    named: list[str] = []
    for name, m in module.named_modules():
        if isinstance(m, (Linear, LayerNormLinear)):
            m.gemm = dense(name) if dense is not None else None
        elif isinstance(m, ExpertLinear):
            m.gemm = grouped(name) if grouped is not None else None
        else:
            continue
        if m.gemm is not None:
            named.append(name)
    return named


__all__ = ["set_gemms"]
