"""Combined 1F1B without pipelining: EP all-to-all of one microbatch hidden behind another's compute.

Megatron's `combined_1f1b_schedule_for_no_pipelining` (docs/megatron-rules.md, "EP all-to-all
overlap"), for
models with `build_schedule_plan` (found on the unwrapped model, like Megatron's
`get_attr_wrapped_model`):

    F(0);  then for i = 1..N-1:  F(i) interleaved with B(i-1);  then B(N-1)

Each microbatch's plan (gptoss_cli/model/schedule_plan.py) is a list of *slots*: the embedding,
one slot per pattern unit (a layer, or a `[..]` group), the post-process/loss node. The forward
of microbatch i (its slots in order) and the backward of microbatch i-1 (its slots in reverse)
are two op streams merged into one (`run_interleaved`): whenever one microbatch has an all-to-all
in flight (issued with async_op=True: gloo's threads on CPU, NCCL's stream on GPU) the other
computes, and a stream waits only when nothing else can run. Both streams advance layer by layer,
so forward layer j runs alongside backward layer L-1-j, but the merge is not cut at layer
boundaries: with the `*E` pattern conversion emits, cutting at every symbol would pair each MoE
layer with an attention layer, leaving one of its two all-to-alls nothing to hide behind. The
merge depends only on the plan's structure, so every rank issues its collectives in the same
order.

With `delay_wgrad_compute` the expert GEMMs queue their weight gradients
(gptoss_cli/model/gemm/grouped.py) and each `dispatch` node runs the queue right after issuing its
backward all-to-all. At the end of the step the queue must be empty, else TrainingError.

`finalize_model_grads_func` (from `get_model_config(model)`, never the provider's config) runs
exactly once, after the last backward; the reduction is deferred (`no_sync_func`) until the last
microbatch's backward, like the plain schedule.

forward_step_func contract: Megatron's. The schedule calls
`forward_step_func(data_iterator, model, return_schedule_plan=True)`, which returns the model's
schedule plan for the next microbatch and its loss_func; the plan's last node calls loss_func on
the model output, so the loss is computed by the caller's own code, once.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator

import torch
from torch import nn

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.gemm.grouped import WgradQueue
from gptoss_cli.model.schedule_plan import COMM, SchedulePlan, ScheduleObserver
from gptoss_cli.parallel.grads import get_attr_wrapped_model, get_model_config
from gptoss_cli.schedule.plain import ForwardStep, StepAccounting, finalizer, forward_backward_no_pipelining


# --------------------------------------------------------------------------------------------
# Merging two streams of ops


START, FINISH, RUN = "start", "finish", "run"


def _forward_ops(slot: list) -> list[tuple[str, Callable[[], None]]]:
    ops = []
    for node in slot:
        if node.kind == COMM:
            ops += [(START, node.start_forward), (FINISH, node.finish_forward)]
        else:
            ops.append((RUN, node.forward))
    return ops


def _backward_ops(slot: list) -> list[tuple[str, Callable[[], None]]]:
    ops = []
    for node in reversed(slot):
        if node.kind == COMM:
            ops += [(START, node.start_backward), (FINISH, node.finish_backward)]
        else:
            ops.append((RUN, node.backward))
    return ops


class _Stream:
    def __init__(self, ops: list):
        self.ops, self.i = ops, 0
        self.issued_at = -1  # sequence number of the comm in flight, -1 when none
        # _next_start[i]: index of the first START at or after op i (len(ops) when none), computed
        # once so that runs_before_comm does not rescan the rest of the stream at every call.
        self._next_start = [len(ops)] * (len(ops) + 1)
        for i in range(len(ops) - 1, -1, -1):
            self._next_start[i] = i if ops[i][0] == START else self._next_start[i + 1]

    @property
    def done(self) -> bool:
        return self.i >= len(self.ops)

    @property
    def next_kind(self) -> str | None:
        return None if self.done else self.ops[self.i][0]

    def runs_before_comm(self) -> float:
        """Compute ops before this stream's next all-to-all (inf: it has none left)."""
        nxt = self._next_start[min(self.i, len(self.ops))]
        return float("inf") if nxt == len(self.ops) else nxt - self.i

    def step(self, seq: int = -1) -> None:
        kind, fn = self.ops[self.i]
        fn()
        self.i += 1
        self.issued_at = seq if kind == START else -1


def run_interleaved(f_ops: list, b_ops: list) -> None:
    """Run two op streams (one microbatch's forward, another's backward) so that each stream's
    communication is in flight while the other computes; deterministic in the ops alone."""
    streams = [s for s in (_Stream(f_ops), _Stream(b_ops)) if not s.done]
    seq = 0
    while any(not s.done for s in streams):
        for s in streams:  # issue communication as early as possible
            if s.next_kind == START:
                s.step(seq)
                seq += 1
        runnable = [s for s in streams if s.next_kind == RUN]
        if runnable:
            # Prefer the stream whose partner has communication to hide; with nothing in flight,
            # the one that reaches its next all-to-all first, so that the link is busy sooner.
            hiding = [s for s in runnable if any(o.next_kind == FINISH for o in streams if o is not s)]
            (hiding[0] if hiding else min(runnable, key=_Stream.runs_before_comm)).step()
            continue
        waiting = [s for s in streams if s.next_kind == FINISH]
        if waiting:
            min(waiting, key=lambda s: s.issued_at).step()


def _slots(plan: SchedulePlan) -> list[list]:
    return [[plan.embedding], *plan.units, [plan.post]]


def plan_forward_ops(plan: SchedulePlan) -> list:
    """A plan's forward as one op stream for `run_interleaved` (its slots in order)."""
    return [op for slot in _slots(plan) for op in _forward_ops(slot)]


def plan_backward_ops(plan: SchedulePlan) -> list:
    """A plan's backward as one op stream for `run_interleaved` (its slots in reverse)."""
    return [op for slot in reversed(_slots(plan)) for op in _backward_ops(slot)]


# --------------------------------------------------------------------------------------------
# The schedule


def forward_backward_combined_1f1b(
    *,
    forward_step_func: ForwardStep,
    data_iterator: Iterator[Any],
    model: nn.Module,
    num_microbatches: int,
    forward_only: bool = False,
    interleave: bool = True,
    observer: ScheduleObserver | None = None,
) -> list[dict[str, Any]]:
    """Same contract as `forward_backward_no_pipelining`; returns one log dict per microbatch.

    interleave=False runs the same plans one microbatch after another (the bench's control);
    observer, if given, watches every all-to-all of the comm nodes and receives the number of
    delayed dW GEMMs (model/schedule_plan.py, `ScheduleObserver`); None: no timing work at all.
    """
    if forward_only:  # nothing to overlap without a backward
        return forward_backward_no_pipelining(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                              model=model, num_microbatches=num_microbatches, forward_only=True)
    config = get_model_config(model)
    finalize = finalizer(config)
    try:
        get_attr_wrapped_model(model, "build_schedule_plan")
    except AttributeError:
        raise ConfigError(
            f"overlap_moe_expert_parallel_comm=true, but {type(model).__name__} and the models it wraps have no "
            "build_schedule_plan (the combined-1F1B schedule cannot split them into nodes)",
            hint="turn overlap off: overlap.overlap_moe_expert_parallel_comm=false overlap.delay_wgrad_compute=false",
        ) from None
    if "return_schedule_plan" not in inspect.signature(forward_step_func).parameters:
        raise ConfigError(
            "overlap_moe_expert_parallel_comm=true, but forward_step_func takes no return_schedule_plan argument",
            hint="forward_step_func(data_iterator, model, return_schedule_plan=False) must return "
                 "(model.build_schedule_plan(...), loss_func) when asked",
        )
    step = StepAccounting(config)
    queue = WgradQueue() if getattr(config, "delay_wgrad_compute", False) else None

    def new_plan() -> SchedulePlan:
        plan, loss_func = forward_step_func(data_iterator, model, return_schedule_plan=True)

        def loss_fn(output: Any) -> tuple[torch.Tensor, Any]:
            loss_sum, num_tokens, extra = loss_func(output)
            step.record(loss_sum, num_tokens, extra)
            return step.scaled(loss_sum), None

        return plan.configure(loss_fn=loss_fn, wgrad_queue=queue, observer=observer)

    def forward(plan: SchedulePlan) -> None:
        run_interleaved(plan_forward_ops(plan), [])

    def backward(plan: SchedulePlan) -> None:
        run_interleaved([], plan_backward_ops(plan))

    def forward_and_backward(f_plan: SchedulePlan, b_plan: SchedulePlan) -> None:
        run_interleaved(plan_forward_ops(f_plan), plan_backward_ops(b_plan))

    try:
        with step.no_sync():
            previous = new_plan()
            forward(previous)
            for _ in range(1, num_microbatches):
                current = new_plan()
                if interleave:
                    forward_and_backward(current, previous)
                else:
                    backward(previous)
                    forward(current)
                previous = current
        backward(previous)
    except BaseException:
        if queue is not None:
            queue.clear()  # the step failed anyway; do not mask its error with a second one
        raise
    if queue is not None:
        queue.finish_step()  # raises if any dW was queued but never run
        if observer is not None:
            observer.delayed_wgrad(queue.executed)
    finalize([model], step.total_tokens)
    return step.logs


__all__ = ["forward_backward_combined_1f1b", "run_interleaved", "plan_forward_ops", "plan_backward_ops"]
