"""The plain microbatch schedule (no pipelining): forward+backward each microbatch, finalise once.

Like Megatron's `forward_backward_no_pipelining`, the callbacks come from the model's own runtime
config, looked up through wrappers with `get_model_config(model)`; the gradient reduction is
deferred (inside `no_sync_func`) for all but the last microbatch, and `finalize_model_grads_func`
runs exactly once per training step, after the last backward, never in forward-only evaluation.

Megatron's contract: `forward_step_func(data_iterator, model)` returns `(output, loss_func)`, and
the schedule calls `loss_func(output) -> (loss_sum, num_tokens, logs)`, where `loss_sum` is the
loss summed (not averaged) over the microbatch's tokens, so that the finaliser can normalise by
the tokens of the whole global batch. The schedule owns when the loss is computed (the overlap
schedule computes it inside the last node of a schedule plan).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from gptoss_cli.errors import TrainingError
from gptoss_cli.parallel.grads import get_model_config

LossFunc = Callable[[Any], "tuple[torch.Tensor, torch.Tensor, dict[str, Any]]"]
ForwardStep = Callable[..., "tuple[Any, LossFunc]"]


def finalizer(config: Any) -> Callable[[list[nn.Module], torch.Tensor], Any]:
    """The config's `finalize_model_grads_func`; a missing one is an error."""
    finalize = getattr(config, "finalize_model_grads_func", None)
    if finalize is None:
        # Megatron skips a missing finaliser silently; that trains on unreduced gradients.
        raise TrainingError(
            "the model's config has no finalize_model_grads_func, gradients would not be reduced",
            hint="install the training callbacks on get_model_config(model), not on the provider's config",
        )
    return finalize


class StepAccounting:
    """One step's bookkeeping, shared by the schedules: the config's `no_sync_func` and
    `grad_scale_func`, the tokens of the step (for the finaliser) and one log dict per microbatch."""

    def __init__(self, config: Any):
        self.no_sync = getattr(config, "no_sync_func", None) or contextlib.nullcontext
        self.grad_scale = getattr(config, "grad_scale_func", None)
        self.total_tokens = torch.zeros((), dtype=torch.float32)
        self.logs: list[dict[str, Any]] = []

    def scaled(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The loss to run backward on."""
        return self.grad_scale(loss_sum) if self.grad_scale is not None else loss_sum

    def record(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor, extra: dict[str, Any]) -> None:
        # Stays on the device: reading it back would block the host once per microbatch.
        self.total_tokens = self.total_tokens + num_tokens.detach().float()
        self.logs.append({"loss_sum": loss_sum.detach(), "num_tokens": num_tokens.detach(), **extra})


def forward_backward_no_pipelining(
    *,
    forward_step_func: ForwardStep,
    data_iterator: Iterator[Any],
    model: nn.Module,
    num_microbatches: int,
    forward_only: bool = False,
) -> list[dict[str, Any]]:
    """Run `num_microbatches` microbatches; returns one log dict per microbatch (with loss_sum, num_tokens)."""
    config = get_model_config(model)
    finalize = None if forward_only else finalizer(config)
    step = StepAccounting(config)

    def one_microbatch() -> None:
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            output, loss_func = forward_step_func(data_iterator, model)
            loss_sum, num_tokens, extra = loss_func(output)
        if not forward_only:
            step.scaled(loss_sum).backward()
        step.record(loss_sum, num_tokens, extra)

    with step.no_sync():
        for _ in range(num_microbatches - 1):
            one_microbatch()
    one_microbatch()

    if finalize is not None:
        finalize([model], step.total_tokens)
    return step.logs


__all__ = ["forward_backward_no_pipelining", "finalizer", "StepAccounting", "ForwardStep", "LossFunc"]
