"""The clamped SwiGLU (GPT-OSS's activation: the eager autograd Function and the choice of kernel) and the
dense MLP layer (`-`) that runs it on one MLP.

Math: docs/architecture.md, "Experts". The compiled single-pass kernels are model/swiglu_kernel.py's;
the experts (model/moe.py) run the same activation per expert.
"""

from __future__ import annotations

import torch
from torch import nn

from gptoss_cli.model.catalog import SWIGLU_KERNEL_UNCONFIGURED
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.gemm.dense import Linear
from gptoss_cli.model.norm import RMSNorm
from gptoss_cli.model.recompute import checkpointed, without_output
from gptoss_cli.model.swiglu_kernel import compiled_clamped_swiglu, compiled_swiglu_available


class _ClampedSwiGLU(torch.autograd.Function):
    """The clamped SwiGLU with a hand-written backward that recomputes from the fc1 output.

    Autograd of the composed ops saves four [N, I] intermediates (clamped gate, sigmoid, their
    product, up + 1) on top of the fc1 output it also keeps, and runs a dozen small kernels in
    backward; this saves only the fc1 output. Gradients as autograd's: the clamps pass gradient
    where the input lies inside the bounds, ends included (torch.clamp's convention), and
    d/dg [g * sigmoid(a*g)] = s * (1 + a*g*(1 - s)) with s = sigmoid(a*g)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        ctx.limit, ctx.alpha = limit, alpha
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        glu = torch.sigmoid_(gate * alpha).mul_(gate)
        return up.clamp(min=-limit, max=limit).add_(1).mul_(glu)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        limit, alpha = ctx.limit, ctx.alpha
        gate, up = gate_up.chunk(2, dim=-1)
        grad = torch.empty_like(gate_up)
        d_gate, d_up = grad.chunk(2, dim=-1)
        g = gate.clamp(max=limit)
        s = torch.sigmoid_(g * alpha)
        torch.mul(g, s, out=d_up).mul_(grad_out).masked_fill_(up.abs() > limit, 0.0)
        d_glu = up.clamp(min=-limit, max=limit).add_(1).mul_(grad_out)
        g.mul_(alpha)
        d_glu_d_gate = torch.addcmul(g, g, s, value=-1.0).add_(1.0).mul_(s)  # s * (1 + a*g*(1 - s))
        torch.mul(d_glu_d_gate, d_glu, out=d_gate).masked_fill_(gate > limit, 0.0)
        return grad, None, None


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float,
                   kernel: str = SWIGLU_KERNEL_UNCONFIGURED) -> torch.Tensor:
    """GPT-OSS activation on fc1 output `[gate; up]` (docs/architecture.md, "Experts"): gate<=limit, |up|<=limit,
    `(up + 1) * gate * sigmoid(alpha * gate)`. `kernel` (model.swiglu_kernel): "auto" computes it with the
    compiled single-pass kernels where they work (model/swiglu_kernel.py), "eager" with the Function above."""
    if kernel == "auto" and gate_up.numel() >= 2 * gate_up.shape[-1] > 0 \
            and compiled_swiglu_available(gate_up.device, gate_up.dtype, _ClampedSwiGLU.apply):
        return compiled_clamped_swiglu(gate_up, limit, alpha)
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return _ClampedSwiGLU.apply(gate_up, limit, alpha)
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


class DenseMLP(nn.Module):
    """The `-` layer's MLP, named as Megatron's: `linear_fc1 [2I, H]` (rows `[gate; up]`) and `linear_fc2 [H, I]`,
    with biases."""

    def __init__(self, hidden_size: int, intermediate_size: int, device=None, dtype=None):
        super().__init__()
        self.linear_fc1 = Linear(hidden_size, 2 * intermediate_size, bias=True, device=device, dtype=dtype)
        self.linear_fc2 = Linear(intermediate_size, hidden_size, bias=True, device=device, dtype=dtype)


class DenseMLPLayer(nn.Module):
    """A `-` layer: x + MLP(RMSNorm(x)), with the experts' math on one dense MLP.

    Our definition (GPT-OSS has no dense layers): `linear_fc1 [2I, H]` with rows `[gate; up]`,
    the clamped SwiGLU of the experts, `linear_fc2 [H, I]`, biases, no routing weight. Names follow
    Megatron's MLP: `pre_mlp_layernorm.weight`, `mlp.linear_fc1.{weight,bias}`, `mlp.linear_fc2.{weight,bias}`.
    """

    symbol = "-"
    recompute_norm = False  # the norm's output is not kept for backward (model/recompute.py, layernorm)
    recompute_mlp = False  # only the layer's input is kept; backward re-runs norm and MLP (mlp)
    swiglu_kernel = SWIGLU_KERNEL_UNCONFIGURED  # model.swiglu_kernel, as GroupedExperts

    def __init__(self, arch: GptOssArch, device=None, dtype=None):
        super().__init__()
        self.limit = arch.swiglu_limit
        self.alpha = arch.swiglu_alpha
        h, i = arch.hidden_size, arch.intermediate_size
        self.pre_mlp_layernorm = RMSNorm(h, arch.rms_norm_eps, device, dtype)
        self.mlp = DenseMLP(h, i, device, dtype)

    def set_recompute(self, pieces: set[str]) -> None:
        """The selective recompute pieces of this layer (model/recompute.py): mlp, layernorm (dropped
        inside mlp: checkpoints do not nest)."""
        self.recompute_mlp = "mlp" in pieces
        self.recompute_norm = "layernorm" in pieces and "mlp" not in pieces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_mlp:
            return x + checkpointed(self._mlp, x)
        return x + self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_norm:
            gate_up = without_output(self.pre_mlp_layernorm, (x,), self.mlp.linear_fc1)
        else:
            gate_up = self.mlp.linear_fc1(self.pre_mlp_layernorm(x))
        return self.mlp.linear_fc2(clamped_swiglu(gate_up, self.limit, self.alpha, self.swiglu_kernel))


__all__ = ["clamped_swiglu", "DenseMLP", "DenseMLPLayer"]
