"""The MoE layer: router, token dispatcher, grouped experts with the clamped SwiGLU.

Math: docs/architecture.md, "Router", "Experts"; names: docs/checkpoint-layouts.md, "Hybrid layout".
The activation and the dense `-` layer are model/mlp.py's; the routing statistics, router losses and
router table model/router_stats.py's.

An `E` layer is split along the boundaries the expert-parallel overlap schedule needs
(docs/megatron-rules.md, "EP all-to-all overlap"): `pre_dispatch` (pre-MLP norm + router) ->
`dispatch` (the token dispatcher's permutation and, with expert parallelism, its all-to-all;
model/dispatcher.py) -> `experts` (grouped GEMMs on the local experts; model/gemm/grouped.py) ->
`combine` (the dispatcher's way back: routing weights, unpermute, reverse all-to-all) + residual.
`forward` composes them.

The layer holds a contiguous range of experts [expert_offset, expert_offset + num_local_experts)
as stacked tensors `[E_local, out, in]` for grouped GEMMs; its state_dict uses the per-expert,
global-id names of the Hybrid checkpoint (`linear_fc1.weight{e}` ...; model/expert_names.py), see `ExpertLinear`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.catalog import SWIGLU_KERNEL_UNCONFIGURED
from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.gemm.dense import ADAPTER
from gptoss_cli.model.dispatcher import AllToAllTokenDispatcher
from gptoss_cli.model.expert_names import PerExpertParams
from gptoss_cli.model.gemm.grouped import GroupedGemm, WgradQueue, grouped_linear
from gptoss_cli.model.mlp import clamped_swiglu
from gptoss_cli.model.norm import RMSNorm
from gptoss_cli.model.recompute import checkpointed, discard_saved, without_output
from gptoss_cli.model.routes import LayerRoutes
from gptoss_cli.model.router_stats import RouterStats, RouterStatsRequest, router_stats


# --------------------------------------------------------------------------------------------
# Router


@dataclass
class RouterOutput:
    logits: torch.Tensor  # [T, E] raw logits (aux loss, diagnostics)
    probs: torch.Tensor  # [T, k] softmax over the k selected logits
    indices: torch.Tensor  # [T, k] global expert ids


class Router(nn.Module):
    """`logits = x W^T + b`; top-k of the raw logits; softmax over those k only (docs/architecture.md, "Router").
    With `routes` (routing replay, model/routes.py) a token may be sent to given ids instead, weighted by the
    softmax of its live logits at them."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, device=None, dtype=None):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_experts, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, routes: LayerRoutes | None = None) -> RouterOutput:
        logits = F.linear(x, self.weight, self.bias)
        if routes is not None:
            probs, indices = routes.route(logits, self.top_k)
            return RouterOutput(logits=logits, probs=probs, indices=indices)
        top, indices = torch.topk(logits, self.top_k, dim=-1)
        return RouterOutput(logits=logits, probs=torch.softmax(top, dim=-1), indices=indices)


# --------------------------------------------------------------------------------------------
# Experts


class ExpertAdapter(Protocol):
    """What an expert layer's adapter computes (LoRA: model/lora.py's ExpertLoraAdapter, one pair per
    expert): the adapted layer's whole output, since under MXFP4 QAT the merged weight is what gets rounded."""

    def adapted(self, base: "ExpertLinear", x: torch.Tensor, tokens_per_expert: torch.Tensor,
                wgrad_queue: WgradQueue | None, name: str) -> torch.Tensor: ...


class ExpertLinear(PerExpertParams):
    """Stacked weights of the local experts, `weight [E_local, out, in]`, `bias [E_local, out]`,
    saved and loaded per expert (see `PerExpertParams`).

    `gemm` computes its grouped GEMMs (model/gemm/grouped.py; None: the default numerics). A frozen
    base may keep the weight as MXFP4 blocks and scales instead (`Mxfp4ExpertLinear`,
    model/mxfp4/experts.py); code that needs only the shape reads `weight_shape`.
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
    def adapter(self) -> ExpertAdapter | None:
        """The adapter model/lora.py attached as the `adapter` submodule; None without one."""
        return dict(self.named_children()).get(ADAPTER)  # not getattr: that is this property

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
    swiglu_kernel = SWIGLU_KERNEL_UNCONFIGURED  # model.swiglu_kernel (see clamped_swiglu); HybridModel.set_swiglu_kernel

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
    adapter = layer.adapter
    if adapter is not None:
        return adapter.adapted(layer, x, tokens_per_expert, wgrad_queue, name)
    return layer(x, tokens_per_expert, wgrad_queue, name)


class MoEMLP(nn.Module):
    """Container that gives the checkpoint names `mlp.router.*` and `mlp.experts.*`."""

    def __init__(self, arch: GptOssArch, num_local_experts: int, expert_offset: int, device=None, dtype=None):
        super().__init__()
        self.router = Router(arch.hidden_size, arch.num_local_experts, arch.num_experts_per_tok, device, dtype)
        self.experts = GroupedExperts(arch, num_local_experts, expert_offset, device, dtype)


class MoELayer(nn.Module):
    """An `E` layer of the Hybrid stack: x + MoE(RMSNorm(x))."""

    symbol = "E"
    recompute_norm = False  # the pre-MLP norm's output is not kept for backward (model/recompute.py)
    # Where the experts' weight gradients wait when a schedule runs them later (a zero-bubble
    # pipeline's W actions: gptoss_cli/schedule/pipeline/stage.py); None: computed in backward.
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
    def pre_dispatch(self, x: torch.Tensor, stats: RouterStatsRequest | None = None,
                     routes: LayerRoutes | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RouterStats | None]:
        """x [B, S, H] -> (normalised tokens [T, H], probs [T, k], global expert indices [T, k],
        the routing's statistics when `stats` asks for them, else None). With `routes` (routing replay,
        model/routes.py) tokens with given ids go to them; the statistics count the experts the tokens
        went to, the router losses' probabilities are the live router's (docs/rl.md, "Routing replay")."""
        if self.recompute_norm:
            hidden, routed = without_output(self.pre_mlp_layernorm, (x,), lambda n: self._route(n, routes))
        else:
            hidden, routed = self._route(self.pre_mlp_layernorm(x), routes)
        got = None if stats is None else router_stats(routed.logits, routed.indices, self.num_experts, stats)
        return hidden, routed.probs, routed.indices, got

    def _route(self, normed: torch.Tensor, routes: LayerRoutes | None = None) -> tuple[torch.Tensor, RouterOutput]:
        hidden = normed.reshape(-1, normed.shape[-1])
        return hidden, self.mlp.router(hidden, routes)

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

    def forward(self, x: torch.Tensor, stats: RouterStatsRequest | None = None, routes: LayerRoutes | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, RouterStats]:
        """The layer's output; with `stats`, (output, the routing's statistics); `routes`: see pre_dispatch."""
        hidden, probs, indices, got = self.pre_dispatch(x, stats, routes)
        expert_input, tokens_per_expert, ctx = self.dispatch(hidden, probs, indices)
        expert_output = self.experts(expert_input, tokens_per_expert)
        out = self.combine(expert_output, ctx, x)
        return out if stats is None else (out, got)
