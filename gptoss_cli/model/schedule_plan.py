"""The HybridModel's schedule plan: one microbatch's forward split into nodes that back-propagate alone.

What the combined-1F1B overlap schedule (gptoss_cli/schedule/combined_1f1b.py) runs
(docs/megatron-rules.md, "EP all-to-all overlap"). For one microbatch the plan holds:
- `embedding` (compute): word embeddings and the rotary cos/sin;
- one *unit* per pattern group (a grouped `[*E]` is one unit, each symbol of the ungrouped `*E`
  is its own unit), with the nodes of its layers:
    `*`  attention      compute   x + Attn(x)
    `-`  mlp            compute   x + MLP(RMSNorm(x))
    `E`  pre_dispatch   compute   RMSNorm, router, dispatcher.dispatch_preprocess (permute by
                                  expert, count exchange)
         dispatch       comm      the all-to-all of the permuted tokens (token_dispatch)
         experts        compute   dispatch_postprocess, fc1, SwiGLU, fc2, combine_preprocess
         combine        comm      the reverse all-to-all (token_combine), then
                                  combine_postprocess (routing weight, unpermute) and the residual
- `post` (compute): final norm, output layer, aux loss, and the loss callback.
The E nodes call the phases of the layer's own token dispatcher (model/dispatcher.py), so the
plan holds no copy of the permutation.

Every node's tensor inputs are DETACHED copies of its producers' outputs, so a node's backward
runs alone (`torch.autograd.backward` on its own outputs) and hands the gradients of its inputs
to the producers. Values that skip nodes are explicit inputs: the residual of an `E` layer goes
from the layer input straight to `combine`, the routing weights from `pre_dispatch` to
`combine`, the router statistics of every `E` layer to `post` (aux and z-loss, telemetry), and cos/sin from
`embedding` to every attention node. A producer read by two consumers sums their gradients.

Comm nodes are not autograd ops: forward issues the all-to-all and finishes it later, backward
issues the reverse all-to-all of the output gradient, so the schedule can put another
microbatch's compute between issue and wait, in both directions. With delayed weight gradients
the expert GEMMs queue their dW (model/gemm/grouped.py, `WgradQueue`) and the `dispatch` node's
backward runs the queue right after issuing its all-to-all, while it is in flight.

Plain PyTorch; the only collectives are the dispatcher's (count exchange, all-to-all) on the EP
group of each layer's dispatcher. No pipeline parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.attention.layer import AttentionLayer
from gptoss_cli.model.dispatcher import PHASES, AsyncAllToAll, Comm, Routing, start_all_to_all
from gptoss_cli.model.gemm.grouped import WgradQueue
from gptoss_cli.model.mlp import DenseMLPLayer
from gptoss_cli.model.moe import MoELayer
from gptoss_cli.model.router_stats import RouterStats, RouterStatsRequest
from gptoss_cli.model.routes import ExpertRoutes, LayerRoutes
from gptoss_cli.model.pattern import ATTENTION, MLP, MOE, HybridPattern, schedule_plan_support

COMPUTE, COMM = "compute", "comm"


class ScheduleObserver(Protocol):
    """Watches a step of the overlap schedule (bench/overlap.py's OverlapStats reads timings this way).

    Optional: with None (training) the plan and the schedule do no timing work at all."""

    def all_to_all(self, name: str, issue: Callable[[], AsyncAllToAll]) -> Any:
        """Comm node `name` issues an all-to-all: call `issue()` and return what the node waits on
        (the handle, or a wrapper whose `wait()` returns the handle's rows)."""

    def delayed_wgrad(self, executed: int) -> None:
        """At the end of a step: the number of delayed weight-gradient GEMMs run (model/gemm/grouped.py)."""


# --------------------------------------------------------------------------------------------
# Nodes


@dataclass(frozen=True)
class Ref:
    """Output `key` of `node` (resolved when the consumer runs)."""

    node: "PlanNode"
    key: str


def _resolve(value: Any) -> Any:
    return value.node.outputs[value.key] if isinstance(value, Ref) else value


def _leaf(value: Any) -> Any:
    """The detach boundary: a floating tensor becomes a fresh leaf that requires grad iff its source did."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_(value.requires_grad)
    return value


class PlanNode:
    """A node: named inputs (Refs to other nodes' outputs, or plain values), named outputs."""

    kind = COMPUTE

    def __init__(self, name: str, inputs: dict[str, Any], *, layer: int | None = None, symbol: str | None = None):
        self.name = name
        self.inputs = inputs
        self.layer = layer
        self.symbol = symbol
        self.outputs: dict[str, Any] | None = None
        self.leaves: dict[str, Any] = {}
        self.out_grads: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def add_grad(self, key: str, grad: torch.Tensor) -> None:
        prev = self.out_grads.get(key)
        self.out_grads[key] = grad if prev is None else prev + grad

    def _take_leaves(self, keys: Any = None) -> dict[str, Any]:
        items = self.inputs.items() if keys is None else ((k, self.inputs[k]) for k in keys)
        self.leaves.update({k: _leaf(_resolve(v)) for k, v in items})
        return self.leaves

    def _backward_outputs(self, outputs: dict[str, Any], seed_key: str | None = None) -> None:
        tensors, grads = [], []
        for key, grad in self.out_grads.items():
            t = outputs.get(key)
            if isinstance(t, torch.Tensor) and t.requires_grad:
                tensors.append(t)
                grads.append(grad)
        if seed_key is not None and seed_key not in self.out_grads:
            loss = outputs.get(seed_key)
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                tensors.append(loss)
                grads.append(torch.ones_like(loss))
        if tensors:
            torch.autograd.backward(tensors, grads)

    def _route_input_grads(self, skip: tuple[str, ...] = ()) -> None:
        for key, leaf in self.leaves.items():
            src = self.inputs.get(key)
            if key in skip or not isinstance(src, Ref) or not isinstance(leaf, torch.Tensor):
                continue
            if leaf.requires_grad and leaf.grad is not None:
                src.node.add_grad(src.key, leaf.grad)

    def release(self) -> None:
        """Drop activations after backward (the outputs stay readable by later consumers until then)."""
        self.leaves = {}
        self.out_grads = {}
        self.outputs = None


class ComputeNode(PlanNode):
    """Runs `fn(**inputs) -> dict of outputs` under autograd on detached inputs."""

    kind = COMPUTE

    def __init__(self, name: str, fn: Callable[..., dict[str, Any]], inputs: dict[str, Any], *,
                 seed_key: str | None = None, **kw: Any):
        super().__init__(name, inputs, **kw)
        self.fn = fn
        self.seed_key = seed_key  # a scalar output that backward seeds with 1 (the loss)

    def forward(self) -> None:
        leaves = self._take_leaves()
        with torch.enable_grad():
            self.outputs = self.fn(**leaves)

    def backward(self) -> None:
        self._backward_outputs(self.outputs, self.seed_key)
        self._route_input_grads()
        self.release()


class CommNode(PlanNode):
    """A variable-size all-to-all of input `x`, issued by `start_*` and completed by `finish_*`.

    Inputs: `x` (Ref), `send` / `recv` (split sizes, Refs to python lists). `post`, if given,
    is compute run after the forward all-to-all on `(received=..., **post_inputs)` (combine's
    unpermute and residual); its backward runs before the reverse all-to-all is issued.
    `after_backward_start` runs right after the backward all-to-all is issued (delayed wgrad).
    """

    kind = COMM

    def __init__(self, name: str, inputs: dict[str, Any], *, group: Any, comm: Comm | None = None,
                 post: Callable[..., dict[str, Any]] | None = None, post_inputs: tuple[str, ...] = (),
                 runs_wgrad: bool = False, **kw: Any):
        super().__init__(name, inputs, **kw)
        self.runs_wgrad = runs_wgrad
        self.group = group
        self.comm = comm  # the layer dispatcher's communication object (None: torch.distributed)
        self.post = post
        self.post_inputs = post_inputs
        self.after_backward_start: Callable[[], Any] | None = None  # set by SchedulePlan.configure
        self.observer: ScheduleObserver | None = None  # set by SchedulePlan.configure
        self._handle = None
        self._x_requires_grad = False
        self._post_outputs: dict[str, Any] | None = None

    def _start(self, x: torch.Tensor, recv: list[int], send: list[int]) -> None:
        if self.observer is None:
            self._handle = start_all_to_all(x, recv, send, self.group, self.comm)
        else:
            self._handle = self.observer.all_to_all(
                self.name, lambda: start_all_to_all(x, recv, send, self.group, self.comm))

    def _wait(self) -> torch.Tensor:
        out = self._handle.wait()
        self._handle = None
        return out

    def start_forward(self) -> None:
        x = _resolve(self.inputs["x"])
        self._x_requires_grad = bool(x.requires_grad)
        self._start(x.detach(), _resolve(self.inputs["recv"]), _resolve(self.inputs["send"]))

    def finish_forward(self) -> None:
        received = self._wait().requires_grad_(self._x_requires_grad)
        if self.post is None:
            self.outputs = {"out": received}
            return
        self.leaves = {"received": received}
        leaves = self._take_leaves(self.post_inputs)
        with torch.enable_grad():
            self.outputs = self.post(**leaves)

    def start_backward(self) -> None:
        if self.post is None:
            grad = self.out_grads.get("out")
        else:
            self._backward_outputs(self.outputs)
            self._route_input_grads(skip=("received",))
            grad = self.leaves["received"].grad
        if grad is None:
            grad = torch.zeros_like(self.leaves["received"] if self.post is not None else self.outputs["out"])
        # The reverse exchange: what I received from rank r goes back to rank r.
        self._start(grad, _resolve(self.inputs["send"]), _resolve(self.inputs["recv"]))
        if self.after_backward_start is not None:
            self.after_backward_start()

    def finish_backward(self) -> None:
        grad_x = self._wait()
        if self._x_requires_grad:
            src = self.inputs["x"]
            src.node.add_grad(src.key, grad_x)
        self.release()

    # Serial execution (no other microbatch to overlap with).
    def forward(self) -> None:
        self.start_forward()
        self.finish_forward()

    def backward(self) -> None:
        self.start_backward()
        self.finish_backward()


# --------------------------------------------------------------------------------------------
# The plan


@dataclass
class SchedulePlan:
    """The nodes of one microbatch: `embedding`, `units` (one list of nodes per pattern group), `post`.

    What the schedule decides is set with `configure` before the plan runs: the loss callback
    (the forward_step's loss_func: model output -> (loss to back-propagate, extra)), the
    delayed-wgrad queue, and an optional observer of the comm nodes (bench timings)."""

    embedding: ComputeNode
    units: list[list[PlanNode]]
    post: ComputeNode
    pattern: HybridPattern
    loss_fn: Callable[[Any], tuple[torch.Tensor, Any]] | None = None
    wgrad_queue: WgradQueue | None = None

    def configure(self, *, loss_fn: Callable[[Any], tuple[torch.Tensor, Any]] | None = None,
                  wgrad_queue: WgradQueue | None = None,
                  observer: ScheduleObserver | None = None) -> "SchedulePlan":
        """Set the loss callback and, for the overlap schedule, delayed wgrad and the comm observer."""
        self.loss_fn, self.wgrad_queue = loss_fn, wgrad_queue
        for node in self.nodes():
            if isinstance(node, CommNode):
                node.observer = observer
                if node.runs_wgrad:  # the backward dispatch all-to-all hides the queued dW GEMMs
                    node.after_backward_start = wgrad_queue.execute if wgrad_queue is not None else None
        return self

    def nodes(self) -> list[PlanNode]:
        return [self.embedding, *(n for unit in self.units for n in unit), self.post]

    def forward(self) -> Any:
        """Run every node in order (serial, no overlap); returns post's outputs."""
        for node in self.nodes():
            node.forward()
        return self.post.outputs

    def backward(self) -> None:
        """Back-propagate node by node in reverse order, from the loss."""
        for node in reversed(self.nodes()):
            node.backward()


# The RouterStats fields a pre_dispatch node hands to `post` (tensors, or the int token count).
_STAT_FIELDS = ("tokens_per_expert", "prob_sum", "num_tokens", "entropy_sum", "z_loss_sum")


def _moe_nodes(plan: SchedulePlan, j: int, layer: MoELayer, x: Ref,
               want: RouterStatsRequest | None, route: LayerRoutes | None = None) -> list[PlanNode]:
    """The four nodes of an E layer, each calling its phases of the layer's token dispatcher."""
    d = layer.dispatcher()
    p = f"decoder.layers.{j}"
    missing = [phase for phase in PHASES if not callable(getattr(d, phase, None))]
    if missing:
        raise ConfigError(
            f"{p}: token dispatcher {type(d).__name__} cannot be split into schedule-plan nodes "
            f"(it has no {', '.join(missing)})",
            hint="use gptoss_cli.model.dispatcher.AllToAllTokenDispatcher with overlap",
        )

    def pre_dispatch(x: torch.Tensor) -> dict[str, Any]:
        hidden, probs, indices, stats = layer.pre_dispatch(x, want, route)
        permuted, prob_of_row, routing = d.dispatch_preprocess(hidden, probs, indices)
        out: dict[str, Any] = {"permuted": permuted, "prob_of_row": prob_of_row, "routing": routing,
                               "send": routing.input_splits, "recv": routing.output_splits}
        if stats is not None:
            out.update({f"stat_{name}": getattr(stats, name) for name in _STAT_FIELDS})
        return out

    def experts(received: torch.Tensor, routing: Routing) -> dict[str, Any]:
        expert_input = d.dispatch_postprocess(received, routing)
        y = layer.mlp.experts(expert_input, routing.tokens_per_expert, wgrad_queue=plan.wgrad_queue,
                              name=f"{p}.mlp.experts")
        return {"rows": d.combine_preprocess(y, routing)}

    def unpermute(received: torch.Tensor, prob_of_row: torch.Tensor, routing: Routing,
                  residual: torch.Tensor) -> dict[str, Any]:
        return {"hidden": residual + d.combine_postprocess(received, prob_of_row, routing).view_as(residual)}

    group = d.ep_group if d.uses_ep else None
    pre = ComputeNode(f"{p}.pre_dispatch", pre_dispatch, {"x": x}, layer=j, symbol=MOE)
    dispatch = CommNode(
        f"{p}.dispatch", {"x": Ref(pre, "permuted"), "send": Ref(pre, "send"), "recv": Ref(pre, "recv")},
        group=group, comm=getattr(d, "comm", None), runs_wgrad=True, layer=j, symbol=MOE,
    )
    exp = ComputeNode(f"{p}.experts", experts, {"received": Ref(dispatch, "out"), "routing": Ref(pre, "routing")},
                      layer=j, symbol=MOE)
    combine = CommNode(
        f"{p}.combine",
        # Backwards: the rows go back the way they came (send and recv swapped).
        {"x": Ref(exp, "rows"), "send": Ref(pre, "recv"), "recv": Ref(pre, "send"),
         "prob_of_row": Ref(pre, "prob_of_row"), "routing": Ref(pre, "routing"), "residual": x},
        group=group, post=unpermute, post_inputs=("prob_of_row", "routing", "residual"),
        comm=getattr(d, "comm", None), layer=j, symbol=MOE,
    )
    return [pre, dispatch, exp, combine]


def moe_layer_nodes(plan: SchedulePlan, j: int, layer: MoELayer, x: Ref,
                    want: RouterStatsRequest | None, route: LayerRoutes | None = None) -> list[PlanNode]:
    """The four nodes of MoE layer `j` reading `x` (pre_dispatch, dispatch, experts, combine; the
    first outputs `stat_<field>` of RouterStats when `want` asks): what a pipeline stage's plan
    (gptoss_cli/schedule/pipeline/plan_stage.py) strings together for its own layers."""
    return _moe_nodes(plan, j, layer, x, want, route)


STAT_FIELDS = _STAT_FIELDS


def build_hybrid_schedule_plan(
    model: Any,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    cu_seqlens: tuple[int, ...] | None = None,
    routes: ExpertRoutes | None = None,
) -> SchedulePlan:
    """The plan of one microbatch for a HybridModel (see the module docstring). Nothing runs yet.

    Without a loss callback (`SchedulePlan.configure`), `post` computes the model's own loss from
    `labels` (`HybridModel.attach_losses`), so a plan can be checked against `model(...)`."""
    ok, reason = schedule_plan_support(model.pattern)
    if not ok:
        raise ConfigError(f"hybrid_layer_pattern {model.pattern.text!r}: {reason}",
                          hint="turn overlap off: overlap.overlap_moe_expert_parallel_comm=false")
    if getattr(model, "recompute", None) is not None and model.recompute.full_units:
        raise ConfigError("full activation recompute cannot run in the overlap schedule (its nodes back-propagate "
                          "alone; a full unit would repeat the all-to-all nodes)",
                          hint="use recompute.recompute_granularity=selective, or turn overlap off")
    want = model.router_stats_request()
    by_layer = model.layer_routes(routes)  # routing replay (model/routes.py): each E layer's ids

    def embedding(input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> dict[str, Any]:
        x = model.embed(input_ids)
        cos, sin = model.rope(input_ids, position_ids, x.dtype, cu_seqlens)
        return {"hidden": x, "cos": cos, "sin": sin}

    emb = ComputeNode("embedding", embedding, {"input_ids": input_ids, "position_ids": position_ids})
    plan = SchedulePlan(embedding=emb, units=[], post=None, pattern=model.pattern)  # type: ignore[arg-type]
    hidden: Ref = Ref(emb, "hidden")
    moe_nodes: list[ComputeNode] = []
    for start, end in model.pattern.groups:
        unit: list[PlanNode] = []
        for j in range(start, end):
            layer = model.decoder.layers[j]
            if isinstance(layer, AttentionLayer):
                node = ComputeNode(
                    f"decoder.layers.{j}.attention",
                    lambda x, cos, sin, _l=layer: {"hidden": _l(x, cos, sin, cu_seqlens)},
                    {"x": hidden, "cos": Ref(emb, "cos"), "sin": Ref(emb, "sin")}, layer=j, symbol=ATTENTION,
                )
                unit.append(node)
            elif isinstance(layer, DenseMLPLayer):
                node = ComputeNode(f"decoder.layers.{j}.mlp", lambda x, _l=layer: {"hidden": _l(x)},
                                   {"x": hidden}, layer=j, symbol=MLP)
                unit.append(node)
            elif isinstance(layer, MoELayer):
                nodes = _moe_nodes(plan, j, layer, hidden, want, None if by_layer is None else by_layer[j])
                moe_nodes.append(nodes[0])
                unit.extend(nodes)
                node = nodes[-1]
            else:  # pragma: no cover - schedule_plan_support already rejected the symbol
                raise ConfigError(f"decoder.layers.{j}: {type(layer).__name__} has no schedule-plan nodes")
            hidden = Ref(node, "hidden")
        plan.units.append(unit)

    post_inputs: dict[str, Any] = {"hidden": hidden, "labels": labels}
    if want is not None:
        for i, pre in enumerate(moe_nodes):
            for name in _STAT_FIELDS:
                post_inputs[f"{name}{i}"] = Ref(pre, f"stat_{name}")

    def post(hidden: torch.Tensor, labels: torch.Tensor | None, **stats: Any) -> dict[str, Any]:
        out = model.output(hidden)
        if want is not None:
            model.attach_router_stats(out, [RouterStats(**{name: stats[f"{name}{i}"] for name in _STAT_FIELDS})
                                            for i in range(len(moe_nodes))])
        model.attach_routes(out, by_layer, input_ids.shape)  # the pre_dispatch nodes have run
        if plan.loss_fn is not None:
            loss, extra = plan.loss_fn(out)
            return {"loss": loss, "extra": extra}
        model.attach_losses(out, labels)
        return {"loss": out.loss, "extra": out}

    plan.post = ComputeNode("post", post, post_inputs, seed_key="loss")
    return plan


__all__ = ["SchedulePlan", "PlanNode", "ComputeNode", "CommNode", "Ref", "ScheduleObserver",
           "build_hybrid_schedule_plan", "moe_layer_nodes", "STAT_FIELDS", "COMPUTE", "COMM"]
