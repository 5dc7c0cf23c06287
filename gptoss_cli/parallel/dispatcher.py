"""The all-to-all token dispatcher for expert parallelism (dropless).

Follows Megatron's alltoall dispatcher (`gpt-oss-reference.md` section 5): permute the routed
copies of the tokens so that they are grouped by global expert; exchange the per-expert counts
with the other EP ranks; `all_to_all_single` the tokens with those split sizes; regroup the
received rows by local expert for the expert GEMMs. `combine` runs the way back: undo the
regrouping, reverse all-to-all, then unpermute by a scatter-add that also applies the routing
weight after the experts' fc2 bias (section 2). Probabilities therefore never travel: they are
applied on the rank that owns the token.

Every step is differentiable (the all-to-all is an autograd Function whose backward is the
reverse all-to-all), so expert gradients land on the rank that holds the expert and token
gradients flow back to the rank that owns the token.

Interface shared with the model's local dispatcher (gptoss_cli/model/moe.py):
    dispatch(hidden [T,H], probs [T,k], indices [T,k])
        -> (expert_input [N,H] sorted by local expert, tokens_per_local_expert LongTensor [E_local], ctx)
    combine(expert_output [N,H], ctx) -> hidden [T,H]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; backward sends the gradients the reverse way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        x = x.contiguous()
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous()
        out = grad.new_empty((sum(ctx.input_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad, ctx.input_splits, ctx.output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
    """Differentiable variable-size all-to-all over `group` (rows of x split by input_splits)."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


@dataclass
class _DispatchCtx:
    num_tokens: int
    token_of_row: torch.Tensor  # [T*k] source token of each permuted row
    prob_of_row: torch.Tensor  # [T*k] routing weight of each permuted row
    input_splits: list[int]
    output_splits: list[int]
    regroup: torch.Tensor | None  # received row order -> local-expert order


class AllToAllTokenDispatcher:
    """Dropless token dispatcher that exchanges tokens between the ranks of one EP group."""

    def __init__(self, num_experts: int, ep_size: int, ep_rank: int, ep_group: Any):
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} not divisible by ep_size={ep_size}")
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.ep_group = ep_group
        self.num_local_experts = num_experts // ep_size
        self.expert_offset = ep_rank * self.num_local_experts

    @classmethod
    def from_state(cls, num_experts: int, state: Any) -> "AllToAllTokenDispatcher":
        return cls(num_experts, state.ep_size, state.ep_rank, state.ep_group)

    def dispatch(
        self, hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, _DispatchCtx]:
        T, k = indices.shape
        flat_expert = indices.reshape(-1)
        # Stable sort keeps the token order within each expert, so results do not depend on EP.
        order = torch.sort(flat_expert, stable=True).indices
        token_of_row = torch.div(order, k, rounding_mode="floor")
        prob_of_row = probs.reshape(-1)[order]
        permuted = hidden[token_of_row]
        counts = torch.bincount(flat_expert, minlength=self.num_experts)  # per global expert
        if self.ep_size == 1 or self.ep_group is None:
            ctx = _DispatchCtx(T, token_of_row, prob_of_row, [permuted.shape[0]], [permuted.shape[0]], None)
            return permuted, counts.to(torch.long), ctx

        E_loc, ep = self.num_local_experts, self.ep_size
        send_counts = counts.view(ep, E_loc)
        recv_counts = torch.empty_like(send_counts)
        # Exchange counts: row r of recv_counts = how many rows rank r sends to each of my experts.
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.ep_group)
        input_splits = send_counts.sum(1).tolist()
        output_splits = recv_counts.sum(1).tolist()
        received = all_to_all(permuted, output_splits, input_splits, self.ep_group)
        # Received rows are ordered (source rank, local expert); regroup to (local expert, source rank).
        local_expert_of_row = torch.repeat_interleave(
            torch.arange(E_loc, device=hidden.device).repeat(ep), recv_counts.reshape(-1).to(hidden.device)
        )
        regroup = torch.sort(local_expert_of_row, stable=True).indices
        expert_input = received[regroup]
        tokens_per_local_expert = recv_counts.sum(0).to(torch.long)
        ctx = _DispatchCtx(T, token_of_row, prob_of_row, input_splits, output_splits, regroup)
        return expert_input, tokens_per_local_expert, ctx

    def combine(self, expert_output: torch.Tensor, ctx: _DispatchCtx) -> torch.Tensor:
        if ctx.regroup is not None:
            inverse = torch.argsort(ctx.regroup)
            expert_output = all_to_all(expert_output[inverse], ctx.input_splits, ctx.output_splits, self.ep_group)
        weighted = expert_output * ctx.prob_of_row.to(expert_output.dtype).unsqueeze(-1)
        out = expert_output.new_zeros((ctx.num_tokens, expert_output.shape[-1]))
        return out.index_add(0, ctx.token_of_row, weighted)


class AsyncAllToAll:
    """An all-to-all in flight: `start_all_to_all(...)` issues it, `wait()` returns the received rows.

    The overlap schedule (gptoss_cli/schedule/combined_1f1b.py) issues the all-to-all of one
    microbatch, computes another microbatch, then waits. gloo runs `async_op=True` collectives on
    its own threads; on NCCL the collective runs on NCCL's stream and `wait()` only makes the
    current stream wait on it (an event), so the host never blocks. The timings (host clock)
    are the collective's own: `issued_at` / `issue_returned` around the issuing call (which may
    do part of the work before returning), `wait_started` / `wait_returned` around wait(); on
    CUDA, wait() synchronises only when `sync_timing` is set (the bench does).
    Not differentiable: the schedule's comm nodes call it in both directions themselves.
    """

    def __init__(self, out: torch.Tensor, work: Any, issued_at: float, sync_timing: bool = False):
        import time

        self.out, self.work, self.issued_at, self.sync_timing = out, work, issued_at, sync_timing
        self.issue_returned = time.perf_counter()
        self.wait_started = self.wait_returned = None

    def wait(self) -> torch.Tensor:
        import time

        self.wait_started = time.perf_counter()
        if self.work is not None:
            self.work.wait()
            if self.sync_timing and self.out.is_cuda:
                torch.cuda.current_stream().synchronize()
        self.wait_returned = time.perf_counter()
        return self.out

    @property
    def in_flight_s(self) -> float:
        return self.wait_returned - self.issued_at

    @property
    def blocked_s(self) -> float:
        """Host time spent blocked on this collective: inside the issuing call and inside wait()."""
        return (self.issue_returned - self.issued_at) + (self.wait_returned - self.wait_started)


def start_all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any,
                     sync_timing: bool = False) -> AsyncAllToAll:
    """Issue a variable-size all-to-all without waiting (rows of x split by input_splits)."""
    import time

    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    issued = time.perf_counter()
    if group is None or dist.get_world_size(group) == 1:
        out.copy_(x)
        return AsyncAllToAll(out, None, issued)
    work = dist.all_to_all_single(out, x, output_splits, input_splits, group=group, async_op=True)
    return AsyncAllToAll(out, work, issued, sync_timing)


__all__ = ["AllToAllTokenDispatcher", "AsyncAllToAll", "all_to_all", "start_all_to_all"]
