"""An MoE layer's forward for the few tokens of a decoding step: only the experts the tokens chose.

The layer's own forward (model/moe.py) is built for training batches: the token dispatcher
permutes thousands of rows, and on the CPU `torch._grouped_mm` walks every expert's group, empty or
not (E groups of select/narrow/mm/add per GEMM, 600 operators per layer at 16 experts). A decoding
step holds one token per prompt, so at top-4 most experts get no row; this form does the same
math on the assignments alone:

    route (the layer's norm and router), sort the B*k assignments by expert, gather their rows,
    fc1 + bias, the clamped SwiGLU, fc2 + bias, times the routing weight, added back per token.

Where the GEMMs run: on the CPU, one `addmm` per expert that got rows, into slices of one
preallocated output (the counts are read on the host, where they already are; a single token
takes its k experts in the order chosen, without sorting); elsewhere, the
grouped GEMM of model/gemm/grouped.py over device-side counts, so nothing is read back to the host
(no device sync per layer and step, which the dispatcher's split sizes would cost).

`decode_moe_available(layer)` says when it applies: a layer holding all experts as plain stacked
weights (not a LoRA adapter, MXFP4 storage or an FP8 GEMM); otherwise the caller runs the layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gptoss_cli.model.gemm.grouped import DEFAULT_GEMM
from gptoss_cli.model.moe import ExpertLinear, MoELayer, clamped_swiglu
from gptoss_cli.model.decode.skinny_gemm import BLOCKED_ROWS, skinny_linear, weight_blocked


def decode_moe_available(layer) -> bool:
    if not isinstance(layer, MoELayer) or layer.num_local_experts != layer.num_experts:
        return False
    experts = layer.mlp.experts
    return all(type(lin) is ExpertLinear and getattr(lin, "adapter", None) is None and lin.gemm in (None, DEFAULT_GEMM)
               for lin in (experts.linear_fc1, experts.linear_fc2))


class DecodeExperts:
    """What a decoding step reads of one MoE layer, prepared once per generation: the layer, and on
    the CPU each expert's (W^T, b) of fc1 and fc2 as views (no copies), so a step does not select
    them again."""

    def __init__(self, layer: MoELayer):
        self.layer = layer
        self.on_host = layer.mlp.router.weight.device.type == "cpu"
        experts = layer.mlp.experts
        self.fc1 = self._views(experts.linear_fc1) if self.on_host else None
        self.fc2 = self._views(experts.linear_fc2) if self.on_host else None
        # whether an expert's weight is one skinny_gemm takes in blocks (asked once: a step then
        # only checks its row count; the activations share the weights' dtype)
        self.fc1_blocks = self.on_host and weight_blocked(experts.linear_fc1.weight[0])
        self.fc2_blocks = self.on_host and weight_blocked(experts.linear_fc2.weight[0])

    @staticmethod
    def _views(lin: ExpertLinear) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(w.t(), b) for w, b in zip(lin.weight.unbind(0), lin.bias.unbind(0))]


def _expert_gemm(x: torch.Tensor, lin: ExpertLinear, views, counts: torch.Tensor, expert_of_row: torch.Tensor | None,
                 host_counts: list[int] | None, blocks: bool = False) -> torch.Tensor:
    """Rows of x sorted by expert -> x_e @ W_e^T + b_e per row (`blocks`: the weights are large
    enough for model/decode/skinny_gemm.py's blocked form, taken at the row counts it serves)."""
    if host_counts is None:
        return DEFAULT_GEMM.fprop(x, lin.weight, counts).add_(lin.bias.index_select(0, expert_of_row))
    out = x.new_empty(x.shape[0], lin.weight.shape[1])
    for (w_t, b), rows, dest, n in zip(views, x.split(host_counts), out.split(host_counts), host_counts):
        if n:
            if blocks and n in BLOCKED_ROWS:
                skinny_linear(rows, w_t.t(), b, out=dest)
            else:
                torch.addmm(b, rows, w_t, out=dest)
    return out


def _one_token(experts_of: DecodeExperts, hidden: torch.Tensor, probs: torch.Tensor,
               chosen: torch.Tensor) -> torch.Tensor:
    """One token on the CPU (a single prompt's step): its k experts in the order chosen, no sorting,
    and the routing weights applied by one [1, k] x [k, H] product."""
    experts = experts_of.layer.mlp.experts
    chosen_ids = chosen[0].tolist()
    gate_up = torch.cat([torch.addmm(experts_of.fc1[e][1], hidden, experts_of.fc1[e][0]) for e in chosen_ids])
    act = clamped_swiglu(gate_up, experts.limit, experts.alpha)
    out = torch.cat([torch.addmm(experts_of.fc2[e][1], row, experts_of.fc2[e][0])
                     for e, row in zip(chosen_ids, act.split(1))])
    return torch.mm(probs.to(out.dtype), out)


@torch.no_grad()
def decode_moe(experts_of: DecodeExperts, x: torch.Tensor, chosen_out: list | None = None) -> torch.Tensor:
    """The layer's output x + MoE(RMSNorm(x)) for x [B, n, H] (n small: a decoding step), equal to
    `layer(x)` up to the order of fp32 sums. `chosen_out`: the experts each token went to, [B*n, k], is
    appended to it (a rollout's routes, model/routes.py)."""
    layer = experts_of.layer
    experts = layer.mlp.experts
    router = layer.mlp.router
    hidden = layer.pre_mlp_layernorm(x).reshape(-1, x.shape[-1])
    logits = F.linear(hidden, router.weight, router.bias)
    top, chosen = torch.topk(logits, router.top_k, dim=-1)
    probs = torch.softmax(top, dim=-1)
    if chosen_out is not None:
        chosen_out.append(chosen)
    if experts_of.on_host and hidden.shape[0] == 1:
        return x + _one_token(experts_of, hidden, probs, chosen).view_as(x)
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    token = order.div(router.top_k, rounding_mode="floor")
    counts = torch.bincount(flat, minlength=layer.num_experts)
    host_counts = counts.tolist() if experts_of.on_host else None
    expert_of_row = None if host_counts is not None else flat.index_select(0, order)
    rows = hidden.index_select(0, token)
    gate_up = _expert_gemm(rows, experts.linear_fc1, experts_of.fc1, counts, expert_of_row, host_counts,
                           experts_of.fc1_blocks)
    act = clamped_swiglu(gate_up, experts.limit, experts.alpha)
    out = _expert_gemm(act, experts.linear_fc2, experts_of.fc2, counts, expert_of_row, host_counts,
                       experts_of.fc2_blocks)
    out.mul_(probs.flatten().index_select(0, order).unsqueeze(-1).to(out.dtype))
    combined = torch.zeros_like(hidden).index_add_(0, token, out)
    return x + combined.view_as(x)


__all__ = ["DecodeExperts", "decode_moe", "decode_moe_available"]
