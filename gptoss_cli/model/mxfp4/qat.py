"""MXFP4 quantisation-aware training of the experts: a grouped gemm that computes with rounded weights.

`Mxfp4QatGemm(inner)` wraps the gemm an `ExpertLinear` would otherwise use (the default numerics,
or an FP8 recipe's) and hands it the weight rounded to MXFP4 in fprop and dgrad; wgrad is the
inner gemm's, unchanged. That is the straight-through estimator: the forward computes
y = x Q(W)^T, the input gradient flows through Q(W) (the weights the forward used), and the
weight gradient dL/dQ(W) = dy^T x lands on the full-precision parameter W as if Q were the
identity. Because it lives at the gemm seam it composes with autograd's `_GroupedLinear`, the
delayed-wgrad queue (which calls `gemm.wgrad` later) and any inner gemm.

Q is `model.mxfp4.round_to_mxfp4` along the weight's last axis, the contraction axis `in` of
`[E, out, in]`: fc1 `[E, 2I, H]` in blocks of 32 hidden features, fc2 `[E, H, I]` in blocks of 32
intermediate features, exactly the blocks `convert --experts mxfp4` writes (HF's `*_blocks`
`[E, out, in/32, 16]`; fc1's [gate; up] row order versus HF's interleaved rows permutes whole
rows, never a block). Biases stay in the model's dtype, as the MXFP4 export stores them.

With LoRA adapters on the experts the forward rounds the merged weight, Q(W + scaling * B @ A)
(`merged_with`, used by model/lora.py): the weight the merged export holds. The merge is recomputed
in dgrad from the parameters rather than kept for backward; they change only at the optimizer
step, after every backward and queued wgrad of the step.
"""

from __future__ import annotations

from typing import Callable

import torch

from gptoss_cli.model.gemm.grouped import DEFAULT_GEMM, GroupedGemm
from gptoss_cli.model.mxfp4.codec import GROUP, round_to_mxfp4

QAT_FORMATS = ("none", "mxfp4")


class Mxfp4QatGemm(GroupedGemm):
    """`inner`'s three GEMMs with the weight rounded to MXFP4 in fprop and dgrad (STE).

    `merge(e, w_e)` (LoRA, `merged_with`) gives the weight to round for local expert e from its base
    weight: the adapters merged in, so the forward rounds W + scaling * B @ A as the export does."""

    def __init__(self, inner: GroupedGemm | None = None, merge: Callable[[int, torch.Tensor], torch.Tensor] | None = None):
        self.inner = inner or DEFAULT_GEMM
        self.merge = merge
        self.name = f"mxfp4-qat({self.inner.name})"

    def merged_with(self, merge: Callable[[int, torch.Tensor], torch.Tensor]) -> "Mxfp4QatGemm":
        """This gemm rounding `merge(e, W_e)` instead of W_e (a frozen base with adapters)."""
        return Mxfp4QatGemm(self.inner, merge)

    def fprop(self, x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return self.inner.fprop(x, rounded_weight(weight, self.merge), tokens_per_expert)

    def dgrad(self, dy: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return self.inner.dgrad(dy, rounded_weight(weight, self.merge), tokens_per_expert)

    def wgrad(self, x: torch.Tensor, dy: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return self.inner.wgrad(x, dy, tokens_per_expert)


def rounded_weight(weight: torch.Tensor, merge: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """An expert weight `[E, out, in]` as the QAT forward (and the MXFP4 export) sees it; with `merge`,
    each expert's `merge(e, W_e)` rounded (one expert at a time: no weight-sized fp32 temporaries),
    in the weight's dtype (exact: every MXFP4 value is a bf16 value)."""
    if weight.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 QAT needs the expert weights' input dimension divisible by {GROUP}, "
                         f"got {tuple(weight.shape)}")
    weight = weight.detach()
    if merge is None:
        return round_to_mxfp4(weight)
    out = torch.empty_like(weight)
    for e in range(weight.shape[0]):
        out[e] = round_to_mxfp4(merge(e, weight[e]))
    return out


def qat_gemms(qat: str, inner=None):
    """The `grouped` argument of `HybridModel.set_gemms` for `precision.qat` (None: no QAT).

    `inner(name)` gives the gemm QAT wraps (an FP8 recipe's), None the default numerics."""
    if qat not in QAT_FORMATS:
        raise ValueError(f"precision.qat={qat!r} is not one of {', '.join(QAT_FORMATS)}")
    if qat == "none":
        return inner
    return lambda name: Mxfp4QatGemm(inner(name) if inner is not None else None)


__all__ = ["Mxfp4QatGemm", "rounded_weight", "qat_gemms", "QAT_FORMATS"]
