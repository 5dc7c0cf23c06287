"""A rank's pipeline stages: `StageModule` (one model chunk of the rank's HybridModel) and its torch stage.

The rank builds ONE HybridModel holding the layers of all its stages (the provider's
`held_layers`), so the gradient buffers, the distributed optimizer and the checkpoint see one
model with every tensor under its global Hybrid name; each of its stages is a `StageModule` that
runs a contiguous range of those layers, wrapped in torch's `PipelineStage` (`RankStage`).

What passes between stages (all floating, as torch's pipelining needs: it makes every received
tensor a leaf that requires grad and sends a gradient back for each):
- the hidden states [micro_batch, seq / CP, hidden] in the params dtype;
- with a router loss on, the router accumulator, float32 [2 E + 2]: tokens routed to each expert,
  the summed router probabilities of each expert (differentiable), the z-loss so far
  (differentiable), the tokens routed. Every stage adds its MoE layers' statistics, so the last
  stage computes the aux loss pooled over all layers and the z-loss summed over them exactly as a
  single model does (model/moe.py), and backward hands every stage the gradient of its own layers'
  terms: the router losses are summed across stages, none left out.
The first stage takes the tokens; every stage reads the microbatch's positions and document
boundaries (packing) from the step's table by the index it is called with (`mb`), which torch
splits from the step's `mb` keyword like any tensor.

Router telemetry does not travel: each stage adds its layers' table rows to the step's
`StepTables`, which the schedule folds into the step's totals.

With a split-backward schedule (zero bubble, DualPipeV) the stage's experts queue their weight
gradients during backward (`MoELayer.wgrad_queue`, model/gemm/grouped.py's WgradQueue, one per
microbatch) and torch's W action runs the queue (`dw_builder`): the backward for inputs (I) is the
rest of the backward, attention, router, norms, embedding and output layer included.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

# Importing torch.distributed.pipelining costs a process one to four seconds; this module (and the
# rest of schedule/pipeline/ but layout.py) is imported only by a run that pipelines, through
# schedule/__init__.py's get_forward_backward_func, so the stage classes can subclass it at module level.
from torch.distributed.pipelining import PipelineStage

from gptoss_cli import torch_private
from gptoss_cli.model.gemm.grouped import WgradQueue
from gptoss_cli.model.loss import HybridOutput
from gptoss_cli.model.moe import MoELayer
from gptoss_cli.model.router_stats import RouterStats, router_table
from gptoss_cli.schedule.pipeline.layout import Stage


@dataclass
class StepTables:
    """What a rank's stages share during one step: the microbatches (by index) and the router rows."""

    microbatches: list[Any] = field(default_factory=list)
    router_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # first MoE layer of a stage -> rows

    def start(self, microbatches: list[Any]) -> None:
        self.microbatches = list(microbatches)
        self.router_rows = {}

    def add_rows(self, key: int, rows: torch.Tensor) -> None:
        prev = self.router_rows.get(key)
        self.router_rows[key] = rows if prev is None else prev + rows


def router_width(num_experts: int) -> int:
    """Elements of the router accumulator: counts, probability sums, z-loss, tokens."""
    return 2 * num_experts + 2


def router_terms(stats: list[RouterStats], num_experts: int, device: torch.device) -> torch.Tensor:
    """One stage's contribution to the router accumulator (see the module docstring)."""
    e = num_experts
    counts = stats[0].tokens_per_expert.float()
    for s in stats[1:]:
        counts = counts + s.tokens_per_expert.float()
    probs = [s.prob_sum for s in stats if s.prob_sum is not None]
    prob = probs[0].float() if probs else torch.zeros(e, dtype=torch.float32, device=device)
    for p in probs[1:]:
        prob = prob + p.float()
    zs = [s.z_loss_sum / s.num_tokens for s in stats if s.z_loss_sum is not None]
    z = zs[0].float() if zs else torch.zeros((), dtype=torch.float32, device=device)
    for t in zs[1:]:
        z = z + t.float()
    total = torch.full((1,), float(sum(s.num_tokens for s in stats)), dtype=torch.float32, device=device)
    return torch.cat([counts, prob, z.reshape(1), total])


def attach_router_losses(out: HybridOutput, acc: torch.Tensor, num_experts: int, aux: bool, z: bool) -> None:
    """The aux loss pooled over every layer of the model and the z-loss summed over them, from the
    accumulator the last stage received (the formulas of model/moe.py's load_balancing_loss and
    router_z_loss)."""
    e = num_experts
    total = acc[2 * e + 1].detach()
    if aux:
        out.aux_loss = e * torch.sum((acc[:e].detach() / total) * (acc[e:2 * e] / total))
    if z:
        out.z_loss = acc[2 * e]


class StageModule(nn.Module):
    """Stage `stage` of the rank's model: its layers (shared with the model), and the embedding or the
    final norm and output layer when it holds them. `forward(*inputs, mb)` returns a tuple of tensors."""

    def __init__(self, model: nn.Module, stage: Stage, tables: StepTables, carry_router: bool):
        super().__init__()
        self.stage, self.tables, self.carry_router = stage, tables, carry_router
        self._model = (model,)  # the rank's HybridModel, not registered twice
        start, end = stage.layers
        self.layers = nn.ModuleList(model.decoder.layers[j] for j in range(start, end))
        self.moe_layers = [layer for layer in self.layers if isinstance(layer, MoELayer)]
        if stage.embedding:
            self.embedding = model.embedding
        if stage.loss:
            self.final_norm = model.decoder.final_norm
            self.output_layer = model.output_layer
        self.defer_wgrad = False  # queue the experts' weight gradients per microbatch (W actions)
        self.wgrad_queues: dict[int, WgradQueue] = {}

    @property
    def model(self) -> nn.Module:
        return self._model[0]

    def forward(self, *inputs: torch.Tensor, mb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        index = int(mb.reshape(-1)[0])
        micro = self.tables.microbatches[index]
        model, (start, end) = self.model, self.stage.layers
        x = model.embed(inputs[0]) if self.stage.embedding else inputs[0]
        acc = None if self.stage.embedding or not self.carry_router else inputs[1]
        queue = WgradQueue() if self.defer_wgrad and self.moe_layers and torch.is_grad_enabled() else None
        if queue is not None:
            self.wgrad_queues[index] = queue
        for layer in self.moe_layers:
            layer.wgrad_queue = queue
        try:
            cos, sin = model.rope(micro.tokens, micro.position_ids, x.dtype, micro.cu_seqlens)
            y, stats = model.run_layers(start, end, x, cos, sin, micro.cu_seqlens, model.router_stats_request())
        finally:
            for layer in self.moe_layers:
                layer.wgrad_queue = None
        if stats:
            self.tables.add_rows(start, router_table(stats))
        if self.stage.loss:
            y = model.decoder.final_norm(y)
        elif y is x and not self.stage.embedding:
            y = x.clone()  # a stage without layers: its output must not be its received buffer
        if not self.carry_router:
            return (y,)
        e = model.arch.num_local_experts
        if acc is None:
            acc = torch.zeros(router_width(e), dtype=torch.float32, device=y.device)
        acc = acc + router_terms(stats, e, y.device) if stats else acc.clone()
        return y, acc

    def output(self, outputs: tuple[torch.Tensor, ...]) -> HybridOutput:
        """The last stage's outputs as the model's output (the LM head deferred, the router losses attached)."""
        model = self.model
        out = HybridOutput(hidden=outputs[0], head_weight=model.output_layer.weight,
                           loss_chunk_tokens=model.loss_chunk_tokens)
        if self.carry_router and model.training:
            attach_router_losses(out, outputs[1], model.arch.num_local_experts, model.aux_loss_coef > 0,
                                 model.z_loss_coef > 0)
        return out


class RankStage(PipelineStage):
    """One stage on this rank: torch's PipelineStage with what gptoss needs around backward. Backward
    runs inside the model's `no_sync` except for the stage's last microbatch (so gradient buckets can
    start reducing during it, overlap_grad_reduce); with `defer_wgrad` the W action runs the
    microbatch's queued expert weight gradients."""

    def __init__(self, module: StageModule, *, index: int, num_stages: int, device: torch.device,
                 input_args: tuple, output_args: tuple, group: Any, microbatches: int,
                 no_sync: Callable[[], Any] | None, defer_wgrad: bool):
        # overriding backward_one_chunk and clear_runtime_states, and reading submod, relies on the
        # stage's undocumented contract: the torch versions it was tested with only
        torch_private.require(torch_private.PIPELINING)
        kwargs: dict[str, Any] = {"input_args": input_args, "output_args": output_args, "group": group}
        if defer_wgrad:  # (a forward-only stage over the same module leaves the flag alone)
            module.defer_wgrad = True
            kwargs["dw_builder"] = self._dw_runner
        super().__init__(module, index, num_stages, device, **kwargs)
        self.microbatches = microbatches
        self.no_sync = no_sync or contextlib.nullcontext
        self.backwards_done = 0
        self.backward_of: int | None = None

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False):
        self.backward_of = bwd_chunk_id
        self.backwards_done += 1
        last = self.backwards_done == self.microbatches
        with contextlib.nullcontext() if last else self.no_sync():
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)

    def _dw_runner(self) -> Callable[[], Any]:
        queue = self.submod.wgrad_queues.pop(self.backward_of, None)
        return queue.execute if queue is not None else (lambda: None)

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        self.backwards_done = 0
        for queue in self.submod.wgrad_queues.values():
            queue.clear()
        self.submod.wgrad_queues.clear()


def stage_metas(stage: Stage, micro_shape: tuple[int, int], hidden: int, dtype: torch.dtype,
                carry_router: bool, num_experts: int) -> tuple[tuple, tuple]:
    """(input_args, output_args) of a stage as meta tensors: torch skips its shape inference (which
    would run a forward and backward of the stage, all-to-alls and gradient side effects included)."""
    act = torch.empty(*micro_shape, hidden, dtype=dtype, device="meta", requires_grad=True)
    acc = torch.empty(router_width(num_experts), dtype=torch.float32, device="meta", requires_grad=True)
    carried = (act, acc) if carry_router else (act,)
    inputs = (torch.empty(*micro_shape, dtype=torch.int64, device="meta"),) if stage.embedding else carried
    return inputs, carried


__all__ = ["StageModule", "StepTables", "RankStage", "stage_metas", "router_terms", "router_width",
           "attach_router_losses"]
