"""The MoE layer: router, token dispatcher, grouped experts with the clamped SwiGLU, and a dense MLP.

Math: docs/architecture.md, "Router", "Experts", "Aux loss"; names: docs/checkpoint-layouts.md,
"Hybrid layout".

An `E` layer is split along the boundaries the expert-parallel overlap schedule needs
(docs/megatron-rules.md, "EP all-to-all overlap"): `pre_dispatch` (pre-MLP norm + router) ->
`dispatch` (the token dispatcher's permutation and, with expert parallelism, its all-to-all;
model/dispatcher.py) -> `experts` (grouped GEMMs on the local experts; model/grouped_gemm.py) ->
`combine` (the dispatcher's way back: routing weights, unpermute, reverse all-to-all) + residual.
`forward` composes them.

The layer holds a contiguous range of experts [expert_offset, expert_offset + num_local_experts)
as stacked tensors `[E_local, out, in]` for grouped GEMMs; its state_dict uses the per-expert,
global-id names of the Hybrid checkpoint (`linear_fc1.weight{e}` ...; model/expert_names.py), see `ExpertLinear`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.dispatcher import AllToAllTokenDispatcher, expert_counts
from gptoss_cli.model.dense_gemm import Linear
from gptoss_cli.model.expert_names import PerExpertParams
from gptoss_cli.model.grouped_gemm import GroupedGemm, WgradQueue, grouped_linear
from gptoss_cli.model.norm import RMSNorm
from gptoss_cli.model.recompute import checkpointed, discard_saved, without_output
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


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float, kernel: str = "eager") -> torch.Tensor:
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


# --------------------------------------------------------------------------------------------
# Router


@dataclass
class RouterOutput:
    logits: torch.Tensor  # [T, E] raw logits (aux loss, diagnostics)
    probs: torch.Tensor  # [T, k] softmax over the k selected logits
    indices: torch.Tensor  # [T, k] global expert ids


class Router(nn.Module):
    """`logits = x W^T + b`; top-k of the raw logits; softmax over those k only (docs/architecture.md, "Router")."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, device=None, dtype=None):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_experts, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> RouterOutput:
        logits = F.linear(x, self.weight, self.bias)
        top, indices = torch.topk(logits, self.top_k, dim=-1)
        return RouterOutput(logits=logits, probs=torch.softmax(top, dim=-1), indices=indices)


# --------------------------------------------------------------------------------------------
# Experts


class ExpertLinear(PerExpertParams):
    """Stacked weights of the local experts, `weight [E_local, out, in]`, `bias [E_local, out]`,
    saved and loaded per expert (see `PerExpertParams`).

    `gemm` computes its grouped GEMMs (model/grouped_gemm.py; None: the default numerics). A frozen
    base may keep the weight as MXFP4 blocks and scales instead (`Mxfp4ExpertLinear`,
    model/mxfp4_experts.py); code that needs only the shape reads `weight_shape`.
    """

    gemm: GroupedGemm | None = None

    def __init__(self, num_local_experts: int, expert_offset: int, out_features: int, in_features: int,
                 device=None, dtype=None):
        super().__init__(num_local_experts, expert_offset)
        self.weight = nn.Parameter(
            torch.empty(num_local_experts, out_features, in_features, device=device, dtype=dtype)
        )
        self.bias = nn.Parameter(torch.zeros(num_local_experts, out_features, device=device, dtype=dtype))

    @property
    def weight_shape(self) -> tuple[int, int, int]:
        """`[E_local, out, in]` of the weight, whatever its storage."""
        return tuple(self.weight.shape)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, wgrad_queue: WgradQueue | None = None,
                name: str = "expert linear", gemm: GroupedGemm | None = None) -> torch.Tensor:
        """Rows of x sorted by local expert -> `[N, out]` (`grouped_linear`; `name` names it in errors).
        `gemm` replaces the layer's own for this call (LoRA under QAT: the gemm that rounds the merge)."""
        return grouped_linear(x, self.weight, self.bias, tokens_per_expert, gemm=gemm or self.gemm,
                              wgrad_queue=wgrad_queue, name=name)


class GroupedExperts(nn.Module):
    """The local experts: fc1 `[2I, H]` with rows `[gate; up]`, clamped SwiGLU, fc2 `[H, I]`.

    Recompute (model/recompute.py): `recompute_act` drops the activation's output (fc2's input)
    and rebuilds it from the fc1 output in backward (moe_act); `recompute_mlp` keeps only the
    experts' input and re-runs fc1, the activation and fc2 in backward (moe)."""

    recompute_act = False
    recompute_mlp = False
    swiglu_kernel = "eager"  # model.swiglu_kernel (see clamped_swiglu); set by HybridModel.set_swiglu_kernel

    def __init__(self, arch: GptOssArch, num_local_experts: int, expert_offset: int, device=None, dtype=None):
        super().__init__()
        self.limit = arch.swiglu_limit
        self.alpha = arch.swiglu_alpha
        h, i = arch.hidden_size, arch.intermediate_size
        self.linear_fc1 = ExpertLinear(num_local_experts, expert_offset, 2 * i, h, device, dtype)
        self.linear_fc2 = ExpertLinear(num_local_experts, expert_offset, h, i, device, dtype)

    def forward(self, expert_input: torch.Tensor, tokens_per_expert: torch.Tensor, *,
                wgrad_queue: WgradQueue | None = None, name: str = "mlp.experts") -> torch.Tensor:
        """expert_input [N, H] sorted by local expert, counts [E_local] -> fc2 output [N, H] (with bias,
        before the routing weight). With `wgrad_queue` the weight gradients wait in the queue
        (delayed wgrad); `name` (the layer's parameter prefix) names them in errors."""
        if self.recompute_mlp:
            return checkpointed(self._mlp, expert_input, tokens_per_expert, wgrad_queue, name, False)
        return self._mlp(expert_input, tokens_per_expert, wgrad_queue, name, self.recompute_act)

    def _mlp(self, expert_input: torch.Tensor, tokens_per_expert: torch.Tensor, wgrad_queue: WgradQueue | None,
             name: str, discard_act: bool) -> torch.Tensor:
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        gate_up = _expert_linear(fc1, expert_input, tokens_per_expert, wgrad_queue, f"{name}.linear_fc1")
        act = clamped_swiglu(gate_up, self.limit, self.alpha, self.swiglu_kernel)
        with discard_saved(act, lambda: clamped_swiglu(gate_up, self.limit, self.alpha, self.swiglu_kernel)) \
                if discard_act \
                else contextlib.nullcontext():
            # an fc2 adapter's saved copy of `act` is discarded too
            return _expert_linear(fc2, act, tokens_per_expert, wgrad_queue, f"{name}.linear_fc2")


def _expert_linear(layer: ExpertLinear, x: torch.Tensor, tokens_per_expert: torch.Tensor,
                   wgrad_queue: WgradQueue | None, name: str) -> torch.Tensor:
    """One expert layer's grouped linear; with a LoRA adapter (model/lora.py, one pair per expert) the
    adapter computes the adapted layer (under MXFP4 QAT the merged weight is what gets rounded)."""
    adapter = getattr(layer, "adapter", None)
    if adapter is not None:
        return adapter.adapted(layer, x, tokens_per_expert, wgrad_queue, name)
    return layer(x, tokens_per_expert, wgrad_queue, name)


class MoEMLP(nn.Module):
    """Container that gives the checkpoint names `mlp.router.*` and `mlp.experts.*`."""

    def __init__(self, arch: GptOssArch, num_local_experts: int, expert_offset: int, device=None, dtype=None):
        super().__init__()
        self.router = Router(arch.hidden_size, arch.num_local_experts, arch.num_experts_per_tok, device, dtype)
        self.experts = GroupedExperts(arch, num_local_experts, expert_offset, device, dtype)


@dataclass(frozen=True)
class RouterStatsRequest:
    """What a training forward asks each MoE layer to return about its routing: the telemetry
    (always: counts, entropy) and the differentiable terms of the losses that are on."""

    aux_loss: bool = False  # prob_sum with gradient (load-balancing loss)
    z_loss: bool = False  # z_loss_sum with gradient (router z-loss)


@dataclass
class RouterStats:
    """One layer's routing in one forward (docs/architecture.md, "Aux loss"; docs/router-telemetry.md)."""

    tokens_per_expert: torch.Tensor  # [E] float, top-k assignment counts (no gradient)
    prob_sum: torch.Tensor | None  # [E] float, sum over tokens of softmax(all E logits) (differentiable); aux loss only
    num_tokens: int
    entropy_sum: torch.Tensor | None = None  # scalar, sum over tokens of the entropy of softmax(all E logits) (no gradient)
    z_loss_sum: torch.Tensor | None = None  # scalar, sum over tokens of logsumexp(logits)^2 (differentiable); z-loss only


def router_stats(logits: torch.Tensor, indices: torch.Tensor, num_experts: int,
                 want: RouterStatsRequest) -> RouterStats:
    """The statistics of one layer's routing: logits [T, E], selected indices [T, k]."""
    logits32 = logits.float()
    prob_sum = torch.softmax(logits32, dim=-1).sum(0) if want.aux_loss else None
    z_sum = torch.logsumexp(logits32, dim=-1).square().sum() if want.z_loss else None
    with torch.no_grad():
        log_p = torch.log_softmax(logits32, dim=-1)
        entropy_sum = -(log_p.exp() * log_p).sum()
        counts = expert_counts(indices.reshape(-1), num_experts).float()
    return RouterStats(tokens_per_expert=counts, prob_sum=prob_sum, num_tokens=logits.shape[0],
                       entropy_sum=entropy_sum, z_loss_sum=z_sum)


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor:
    """Mixtral/HF load-balancing loss pooled over layers: `E * sum_e f_e * P_e` with
    f_e = assignments to e / (layers * tokens) and P_e = mean router probability of e.
    Equal to transformers' `load_balancing_loss_func` for the same router logits."""
    total = sum(s.num_tokens for s in stats)
    f = torch.stack([s.tokens_per_expert for s in stats]).sum(0) / total
    p = torch.stack([s.prob_sum for s in stats]).sum(0) / total
    return num_experts * torch.sum(f * p)


def router_z_loss(stats: list[RouterStats]) -> torch.Tensor:
    """Megatron's router z-loss, unscaled, summed over layers as each layer adds its own:
    sum over layers of mean over tokens of logsumexp(logits)^2 (ST-MoE, Zoph et al. 2022)."""
    return sum(s.z_loss_sum / s.num_tokens for s in stats)


# Columns of a router table row: E expert counts, then these two.
ENTROPY_COL, TOKENS_COL = -2, -1


def router_table(stats: list[RouterStats]) -> torch.Tensor:
    """float64 [L, E + 2], one row per MoE layer: tokens routed to each expert (top-k assignments),
    the summed router entropy, the tokens routed. Rows of several microbatches and ranks add up."""
    return torch.stack([
        torch.cat([s.tokens_per_expert.double(), s.entropy_sum.double().reshape(1),
                   s.tokens_per_expert.new_full((1,), float(s.num_tokens), dtype=torch.float64)])
        for s in stats
    ]).detach()


class MoELayer(nn.Module):
    """An `E` layer of the Hybrid stack: x + MoE(RMSNorm(x))."""

    symbol = "E"
    recompute_norm = False  # the pre-MLP norm's output is not kept for backward (model/recompute.py)
    # Where the experts' weight gradients wait when a schedule runs them later (a zero-bubble
    # pipeline's W actions: gptoss_cli/pipeline/stage.py); None: computed in backward.
    wgrad_queue: WgradQueue | None = None

    def __init__(
        self,
        arch: GptOssArch,
        *,
        expert_offset: int = 0,
        num_local_experts: int | None = None,
        token_dispatcher: AllToAllTokenDispatcher | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        num_local_experts = arch.num_local_experts if num_local_experts is None else num_local_experts
        if (
            expert_offset < 0
            or num_local_experts <= 0
            or expert_offset + num_local_experts > arch.num_local_experts
        ):
            raise ConfigError(
                f"local expert range [{expert_offset}, {expert_offset + num_local_experts}) is not inside "
                f"the {arch.num_local_experts} experts of the architecture"
            )
        self.num_experts = arch.num_local_experts
        self.expert_offset = expert_offset
        self.num_local_experts = num_local_experts
        self.pre_mlp_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, device, dtype)
        self.mlp = MoEMLP(arch, num_local_experts, expert_offset, device, dtype)
        if token_dispatcher is None and num_local_experts == arch.num_local_experts:
            token_dispatcher = AllToAllTokenDispatcher(arch.num_local_experts)
        # None when the layer holds a slice of the experts: the caller must plug in a dispatcher
        # that moves tokens between ranks.
        self.token_dispatcher = token_dispatcher

    def set_recompute(self, pieces: set[str]) -> None:
        """The selective recompute pieces of this layer (model/recompute.py): layernorm, moe, moe_act
        (dropped inside moe: checkpoints do not nest)."""
        self.recompute_norm = "layernorm" in pieces
        self.mlp.experts.recompute_mlp = "moe" in pieces
        self.mlp.experts.recompute_act = "moe_act" in pieces and "moe" not in pieces

    # --- the four stages (the overlap schedule's node split) --------------------------------
    def pre_dispatch(self, x: torch.Tensor, stats: RouterStatsRequest | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RouterStats | None]:
        """x [B, S, H] -> (normalised tokens [T, H], probs [T, k], global expert indices [T, k],
        the routing's statistics when `stats` asks for them, else None)."""
        if self.recompute_norm:
            hidden, routed = without_output(self.pre_mlp_layernorm, (x,), self._route)
        else:
            hidden, routed = self._route(self.pre_mlp_layernorm(x))
        got = None if stats is None else router_stats(routed.logits, routed.indices, self.num_experts, stats)
        return hidden, routed.probs, routed.indices, got

    def _route(self, normed: torch.Tensor) -> tuple[torch.Tensor, RouterOutput]:
        hidden = normed.reshape(-1, normed.shape[-1])
        return hidden, self.mlp.router(hidden)

    def dispatcher(self) -> AllToAllTokenDispatcher:
        """The layer's token dispatcher; a layer holding a slice of the experts needs an EP one."""
        if self.token_dispatcher is None:
            raise ConfigError(
                f"this MoE layer holds experts [{self.expert_offset}, "
                f"{self.expert_offset + self.num_local_experts}) of {self.num_experts} but has no token_dispatcher",
                hint="set layer.token_dispatcher to an expert-parallel AllToAllTokenDispatcher",
            )
        return self.token_dispatcher

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor):
        return self.dispatcher().dispatch(hidden, probs, indices)

    def experts(self, expert_input: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return self.mlp.experts(expert_input, tokens_per_expert, wgrad_queue=self.wgrad_queue)

    def combine(self, expert_output: torch.Tensor, ctx: Any, residual: torch.Tensor) -> torch.Tensor:
        out = self.token_dispatcher.combine(expert_output, ctx)
        return residual + out.view_as(residual)

    def forward(self, x: torch.Tensor, stats: RouterStatsRequest | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, RouterStats]:
        """The layer's output; with `stats`, (output, the routing's statistics)."""
        hidden, probs, indices, got = self.pre_dispatch(x, stats)
        expert_input, tokens_per_expert, ctx = self.dispatch(hidden, probs, indices)
        expert_output = self.experts(expert_input, tokens_per_expert)
        out = self.combine(expert_output, ctx, x)
        return out if stats is None else (out, got)


class DenseMLPLayer(nn.Module):
    """A `-` layer: x + MLP(RMSNorm(x)), with the experts' math on one dense MLP.

    Our definition (GPT-OSS has no dense layers): `linear_fc1 [2I, H]` with rows `[gate; up]`,
    the clamped SwiGLU of the experts, `linear_fc2 [H, I]`, biases, no routing weight. Names follow
    Megatron's MLP: `pre_mlp_layernorm.weight`, `mlp.linear_fc1.{weight,bias}`, `mlp.linear_fc2.{weight,bias}`.
    """

    symbol = "-"
    recompute_norm = False  # the norm's output is not kept for backward (model/recompute.py, layernorm)
    recompute_mlp = False  # only the layer's input is kept; backward re-runs norm and MLP (mlp)
    swiglu_kernel = "eager"  # model.swiglu_kernel, as GroupedExperts

    def __init__(self, arch: GptOssArch, device=None, dtype=None):
        super().__init__()
        self.limit = arch.swiglu_limit
        self.alpha = arch.swiglu_alpha
        h, i = arch.hidden_size, arch.intermediate_size
        self.pre_mlp_layernorm = RMSNorm(h, arch.rms_norm_eps, device, dtype)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = Linear(h, 2 * i, bias=True, device=device, dtype=dtype)
        self.mlp.linear_fc2 = Linear(i, h, bias=True, device=device, dtype=dtype)

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
