"""EP all-to-all overlap under pipelining: a stage's microbatch as schedule-plan nodes, and DualPipeV's overlap hook.

With `overlap_moe_expert_parallel_comm` and the `dualpipev` schedule, every forward and backward of
a stage runs as the nodes of a schedule plan (model/schedule_plan.py: detached node inputs, the
MoE layers' all-to-alls as comm nodes issued and waited apart), and torch's `OVERLAP_F_B` action,
the forward of one microbatch on one of the rank's stages beside the backward of another microbatch
on its other stage, runs the two plans' op streams merged by the combined-1F1B schedule's
`run_interleaved`: whenever one has an all-to-all in flight the other computes, deterministically
in the plans' structure alone (so every rank of an EP group issues its collectives in one order).

`StagePlan` is one microbatch through one stage: an entry node (the embedding on the first stage,
else the received hidden states and router accumulator), the nodes of its layers, an exit node
(the final norm on the last stage, the router accumulator out). Backward is seeded at the exit node
by the received gradients, or on the last stage by the loss torch computed from its outputs; the
entry node's input gradients are what the stage sends back. With `delay_wgrad_compute` the experts'
weight gradients are queued and each dispatch node runs the queue behind its backward all-to-all,
as without pipelining; the schedule's W actions then have nothing left to do.

`overlap_f_b` is the function registered for `OVERLAP_F_B`. torch's runtime does the bookkeeping of
a forward and of a backward (waiting for what was received, the V's same-rank hand-over, the loss,
the backward counter) inside its own `_step_microbatches`, so the hook repeats it against the
runtime's attributes (docs/pipeline-parallel.md, "where it fell short").
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from gptoss_cli import torch_private
from gptoss_cli.model.attention.layer import AttentionLayer
from gptoss_cli.model.gemm.grouped import WgradQueue
from gptoss_cli.model.mlp import DenseMLPLayer
from gptoss_cli.model.moe import MoELayer
from gptoss_cli.model.router_stats import RouterStats, router_table
from gptoss_cli.model.schedule_plan import STAT_FIELDS, ComputeNode, PlanNode, Ref, SchedulePlan, moe_layer_nodes
from gptoss_cli.schedule.pipeline.stage import RankStage, StageModule, router_terms, router_width
from gptoss_cli.schedule.combined_1f1b import plan_backward_ops, plan_forward_ops, run_interleaved


class _Entry(ComputeNode):
    """The stage's first node; keeps the gradients of its inputs (what the stage sends back)."""

    input_grads: dict[str, torch.Tensor | None] = {}

    def backward(self) -> None:
        self._backward_outputs(self.outputs)
        self.input_grads = {k: leaf.grad for k, leaf in self.leaves.items() if isinstance(leaf, torch.Tensor)}
        self.release()


class _Exit(ComputeNode):
    """The stage's last node; its backward starts from the loss on the last stage, else from the
    gradients received for its outputs (`add_grad`)."""

    loss: torch.Tensor | None = None

    def backward(self) -> None:
        if self.loss is not None:
            torch.autograd.backward(self.loss)
            self.loss = None
        else:
            self._backward_outputs(self.outputs)
        self._route_input_grads()
        self.release()


class StagePlan:
    """One microbatch through one stage as plan nodes (see the module docstring)."""

    def __init__(self, module: StageModule, inputs: tuple, micro: Any, queue: WgradQueue | None, observer: Any = None):
        model, stage = module.model, module.stage
        self.module = module
        want = model.router_stats_request()
        cu = micro.cu_seqlens

        def entry(**kw: Any) -> dict[str, Any]:
            x = model.embed(kw["x"]) if stage.embedding else kw["x"]
            cos, sin = model.rope(micro.tokens, micro.position_ids, x.dtype, cu)
            return {"hidden": x, "cos": cos, "sin": sin, "acc": kw.get("acc")}

        names = ("x", "acc") if module.carry_router and not stage.embedding else ("x",)
        self.entry = _Entry("stage_in", entry, dict(zip(names, inputs)))
        plan = SchedulePlan(embedding=self.entry, units=[], post=None, pattern=model.pattern)  # type: ignore[arg-type]
        hidden, moe_pre = Ref(self.entry, "hidden"), []
        for j in range(*stage.layers):
            layer = model.decoder.layers[j]
            if isinstance(layer, MoELayer):
                nodes = moe_layer_nodes(plan, j, layer, hidden, want)
                moe_pre.append(nodes[0])
            elif isinstance(layer, AttentionLayer):
                nodes = [ComputeNode(f"decoder.layers.{j}.attention",
                                     lambda x, cos, sin, _l=layer: {"hidden": _l(x, cos, sin, cu)},
                                     {"x": hidden, "cos": Ref(self.entry, "cos"), "sin": Ref(self.entry, "sin")})]
            elif isinstance(layer, DenseMLPLayer):
                nodes = [ComputeNode(f"decoder.layers.{j}.mlp", lambda x, _l=layer: {"hidden": _l(x)}, {"x": hidden})]
            else:  # pragma: no cover - the rules refuse patterns the plan cannot split
                raise TypeError(f"decoder.layers.{j}: {type(layer).__name__} has no schedule-plan nodes")
            plan.units.append(nodes)
            hidden = Ref(nodes[-1], "hidden")
        exit_inputs: dict[str, Any] = {"hidden": hidden, "acc": Ref(self.entry, "acc")}
        if want is not None:
            for i, pre in enumerate(moe_pre):
                exit_inputs.update({f"{name}{i}": Ref(pre, f"stat_{name}") for name in STAT_FIELDS})

        def exit_fn(hidden: torch.Tensor, acc: torch.Tensor | None, **stats: Any) -> dict[str, Any]:
            got = [RouterStats(**{name: stats[f"{name}{i}"] for name in STAT_FIELDS}) for i in range(len(moe_pre))]
            if got:
                module.tables.add_rows(stage.layers[0], router_table(got))
            out = {"hidden": model.decoder.final_norm(hidden) if stage.loss else hidden}
            if module.carry_router:
                e = model.arch.num_local_experts
                if acc is None:
                    acc = torch.zeros(router_width(e), dtype=torch.float32, device=hidden.device)
                out["acc"] = acc + router_terms(got, e, hidden.device) if got else acc * 1
            return out

        self.exit = _Exit("stage_out", exit_fn, exit_inputs)
        plan.post = self.exit
        self.plan = plan.configure(wgrad_queue=queue, observer=observer)
        self.names = names

    def forward_ops(self) -> list:
        return plan_forward_ops(self.plan)

    def outputs(self) -> tuple[torch.Tensor, ...]:
        out = self.exit.outputs
        return (out["hidden"], out["acc"]) if self.module.carry_router else (out["hidden"],)

    def seed(self, loss: torch.Tensor | None, grads: tuple | None) -> None:
        """Where backward starts: the loss (last stage) or the gradients received for the outputs."""
        if loss is not None:
            self.exit.loss = loss
            return
        for key, g in zip(("hidden", "acc"), grads or ()):
            if g is not None:
                self.exit.add_grad(key, g)

    def backward_ops(self) -> list:
        return plan_backward_ops(self.plan)

    def input_grads(self) -> tuple[torch.Tensor | None, ...]:
        return tuple(self.entry.input_grads.get(name) for name in self.names)


class PlanStage(RankStage):
    """A stage for EP overlap under pipelining: `forward_one_chunk` and `backward_one_chunk` run a
    `StagePlan` (each also split in begin/end halves, which `overlap_f_b` interleaves)."""

    queue: WgradQueue | None = None  # the runtime's delayed-wgrad queue (None: wgrads in backward)
    observer: Any = None  # a ScheduleObserver watching the all-to-alls (bench/pipeline.py)

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["defer_wgrad"] = False
        super().__init__(*args, **kwargs)
        self.dw_builder = lambda: (lambda: None)  # W: the queue already ran behind the all-to-alls
        self.plans: dict[int, tuple[StagePlan, list]] = {}

    def begin_forward(self, index: int, args: tuple, kwargs: dict | None) -> StagePlan:
        inputs = tuple(args) if self.is_first else tuple(torch_private.retrieve_recv_activations(self, index))
        micro = self.submod.tables.microbatches[int(kwargs["mb"].reshape(-1)[0])]
        plan = StagePlan(self.submod, inputs, micro, self.queue, self.observer)
        self.plans[index] = (plan, [t for t in inputs if isinstance(t, torch.Tensor)])
        return plan

    def end_forward(self, index: int, plan: StagePlan) -> tuple[torch.Tensor, ...]:
        outputs = plan.outputs()
        self.fwd_cache[index] = (outputs, self.plans[index][1])
        return outputs

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple, kwargs: dict | None = None,
                          save_forward_output: bool = True):
        plan = self.begin_forward(fwd_chunk_id, args, kwargs)
        run_interleaved(plan.forward_ops(), [])
        return self.end_forward(fwd_chunk_id, plan)

    def begin_backward(self, index: int, loss: torch.Tensor | None) -> tuple[StagePlan, Any]:
        """The plan seeded for backward, and the gradient-sync context of this microbatch."""
        torch_private.check_chunk_id(self, index)
        plan, _ = self.plans.pop(index)
        self.fwd_cache.pop(index, None)
        grads = None if self.is_last else tuple(torch_private.retrieve_recv_grads(self, index))
        plan.seed(loss if self.is_last else None, grads)
        self.backwards_done += 1
        sync = contextlib.nullcontext() if self.backwards_done == self.microbatches else self.no_sync()
        return plan, sync

    def end_backward(self, index: int, plan: StagePlan, full_backward: bool = True) -> None:
        self.bwd_cache[index] = plan.input_grads()
        if not full_backward:
            self.dw_runner[index] = lambda: None

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False):
        if not self.has_backward:
            return
        plan, sync = self.begin_backward(bwd_chunk_id, loss)
        with sync:
            run_interleaved([], plan.backward_ops())
        self.end_backward(bwd_chunk_id, plan, full_backward)

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        self.plans.clear()


# Overlapped forward-backward pairs run in this process (diagnostics: tests and bench/pipeline.py read it).
OVERLAPPED = {"pairs": 0}


def overlap_f_b(action: Any, ctx: Any) -> None:
    """torch's OVERLAP_F_B action of DualPipeV: the forward sub-action and the backward sub-action run as
    two plans' op streams merged by `run_interleaved`, with the runtime's bookkeeping of each around it."""
    schedule = ctx.schedule_ref
    stages = {s.stage_index: s for s in torch_private.schedule_stages(schedule)}
    fwd, bwd = action.sub_actions
    fs, bs = stages[fwd.stage_index], stages[bwd.stage_index]
    f_mb, b_mb = fwd.microbatch_index, bwd.microbatch_index
    if not fs.is_first and fwd.stage_index - 1 not in stages:
        torch_private.wait_batch_p2p(schedule.fwd_recv_ops.pop((fwd.stage_index, f_mb)))
    if not bs.is_last and bwd.stage_index + 1 not in stages:
        torch_private.wait_batch_p2p(schedule.bwd_recv_ops.pop((bwd.stage_index, b_mb)))
    f_plan = fs.begin_forward(f_mb, ctx.arg_mbs[f_mb], ctx.kwarg_mbs[f_mb])
    loss = torch_private.schedule_loss(schedule, bs, b_mb)
    schedule.backward_counter[bwd.stage_index] += 1
    b_plan, sync = bs.begin_backward(b_mb, loss)
    with sync:
        run_interleaved(f_plan.forward_ops(), b_plan.backward_ops())
    OVERLAPPED["pairs"] += 1
    output = fs.end_forward(f_mb, f_plan)
    torch_private.compute_schedule_loss(schedule, fs, output, ctx.target_mbs, f_mb)
    if fwd.stage_index + 1 in stages:
        stages[fwd.stage_index + 1].set_local_fwd_input(output, f_mb)
    bs.end_backward(b_mb, b_plan)
    if bwd.stage_index - 1 in stages:
        stages[bwd.stage_index - 1].set_local_bwd_input(bs.get_local_bwd_output(b_mb), b_mb)


__all__ = ["StagePlan", "PlanStage", "overlap_f_b", "OVERLAPPED"]
