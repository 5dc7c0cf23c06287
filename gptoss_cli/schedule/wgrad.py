"""Delayed weight gradients: linear backward computes only dX and queues what dW needs.

`delay_wgrad_compute` (gpt-oss-reference.md section 5): in backward, the expert GEMMs compute
the input gradient at once (the next node back needs it) and push `(x, dY)` into a
`WgradQueue`; the overlap schedule later runs `queue.execute()` while the backward dispatch
all-to-all of the same layer is in flight, so the weight-gradient GEMMs fill time that would
otherwise be spent waiting on the network.

The queued work adds into `param.main_grad` (the fp32 accumulation buffer of
`gptoss_cli.parallel.grads`) when the parameter has one, else into `param.grad`, exactly what
the post-accumulate hook would have done with an ordinary backward.

Nothing may be dropped: `WgradQueue.finish_step()` raises TrainingError when work is left,
so a schedule that forgot to run it fails loudly instead of training on missing gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gptoss_cli.errors import TrainingError
from gptoss_cli.model.moe import _grouped_mm_usable


def _accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    main = getattr(param, "main_grad", None)
    if main is not None:
        main.add_(grad)
    elif param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


def _offsets(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(tokens_per_expert, 0).to(torch.int32)


def grouped_input_grad(dy: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """dX of `grouped_linear`: rows of dy [N, out] by expert, weight [E, out, in] -> [N, in]."""
    if _grouped_mm_usable(dy, weight):
        try:
            return torch._grouped_mm(dy, weight, offs=_offsets(tokens_per_expert))
        except RuntimeError:  # a kernel that wants another operand layout (checked on CPU only): loop
            pass
    chunks = torch.split(dy, tokens_per_expert.tolist())
    outs = [c @ weight[e] for e, c in enumerate(chunks)]
    return torch.cat(outs) if outs else dy.new_zeros(0, weight.shape[-1])


def grouped_weight_grad(x: torch.Tensor, dy: torch.Tensor, tokens_per_expert: torch.Tensor,
                        num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dW [E, out, in], db [E, out]) of `grouped_linear` from its input x [N, in] and dy [N, out]."""
    counts = tokens_per_expert.tolist()
    db = torch.stack([c.sum(0) for c in torch.split(dy, counts)]) if counts else dy.new_zeros(0, dy.shape[1])
    if _grouped_mm_usable(x, dy.new_empty(num_experts, dy.shape[1], x.shape[1])) and x.shape[0] > 0:
        try:
            return torch._grouped_mm(dy.t(), x, offs=_offsets(tokens_per_expert)), db
        except RuntimeError:  # as in grouped_input_grad
            pass
    return torch.stack([d.t() @ xe for d, xe in zip(torch.split(dy, counts), torch.split(x, counts))]), db


@dataclass
class _Pending:
    weight: torch.Tensor
    bias: torch.Tensor
    x: torch.Tensor
    dy: torch.Tensor
    tokens_per_expert: torch.Tensor
    name: str


class WgradQueue:
    """FIFO of weight-gradient GEMMs deferred from backward (one per model, shared by its layers)."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []
        self.executed = 0  # GEMM pairs run since construction (tests and the bench read it)

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, item: _Pending) -> None:
        self._pending.append(item)

    def execute(self) -> int:
        """Run every queued dW/db GEMM now, accumulating into the parameters; returns how many."""
        n = 0
        while self._pending:
            p = self._pending.pop(0)
            dw, db = grouped_weight_grad(p.x, p.dy, p.tokens_per_expert, p.weight.shape[0])
            _accumulate_grad(p.weight, dw)
            _accumulate_grad(p.bias, db)
            n += 1
        self.executed += n
        return n

    def clear(self) -> None:
        """Forget queued work (only after a failed step, whose gradients are discarded anyway)."""
        self._pending.clear()

    def finish_step(self) -> None:
        """End-of-step check: queued work that was never run would silently lose gradients."""
        if self._pending:
            names = sorted({p.name for p in self._pending})
            count = len(self._pending)
            self._pending.clear()
            raise TrainingError(
                f"{count} delayed weight-gradient GEMMs were queued but never run this step "
                f"(for {', '.join(names[:4])}{'...' if len(names) > 4 else ''}); their gradients would be lost",
                hint="delay_wgrad_compute works only inside the overlap schedule, which runs the queue; "
                     "set overlap.delay_wgrad_compute=false otherwise",
            )


class _DelayedWgradGroupedLinear(torch.autograd.Function):
    """`grouped_linear` whose backward returns only dX and queues (x, dY) for dW and db.

    The parameters reach the Function inside a tuple, not as tensor inputs: autograd then has no
    gradient edge to them at all (returning None for a parameter input would still fire its
    post-accumulate hook with no gradient). The queue accumulates their gradients instead."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, params: tuple[torch.Tensor, torch.Tensor],
                tokens_per_expert: torch.Tensor, queue: WgradQueue, name: str) -> torch.Tensor:
        from gptoss_cli.model.moe import grouped_linear

        weight, bias = params
        ctx.save_for_backward(x, tokens_per_expert)
        ctx.params, ctx.queue, ctx.name = params, queue, name
        return grouped_linear(x, weight.detach(), bias.detach(), tokens_per_expert)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x, tokens_per_expert = ctx.saved_tensors
        weight, bias = ctx.params
        dy = dy.contiguous()
        dx = grouped_input_grad(dy, weight.detach(), tokens_per_expert) if ctx.needs_input_grad[0] else None
        if weight.requires_grad or bias.requires_grad:
            ctx.queue.push(_Pending(weight, bias, x.detach(), dy, tokens_per_expert, ctx.name))
        return dx, None, None, None, None


def delayed_grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                           tokens_per_expert: torch.Tensor, *, queue: WgradQueue, name: str = "expert linear"):
    """Drop-in for `gptoss_cli.model.moe.grouped_linear` with the weight gradient deferred to `queue`."""
    if not torch.is_grad_enabled():
        from gptoss_cli.model.moe import grouped_linear

        return grouped_linear(x, weight, bias, tokens_per_expert)
    return _DelayedWgradGroupedLinear.apply(x, (weight, bias), tokens_per_expert, queue, name)


def delayed_linear_for(queue: WgradQueue, names: dict[int, str] | None = None):
    """A `linear=` callable for `GroupedExperts.forward` that queues dW into `queue`; `names` maps
    id(weight) to the parameter's name for error messages."""
    names = names or {}

    def linear(x, weight, bias, tokens_per_expert):
        return delayed_grouped_linear(x, weight, bias, tokens_per_expert, queue=queue,
                                      name=names.get(id(weight), "expert linear"))

    return linear


__all__ = ["WgradQueue", "delayed_grouped_linear", "delayed_linear_for", "grouped_input_grad", "grouped_weight_grad"]
