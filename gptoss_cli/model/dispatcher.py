"""The MoE token dispatcher (dropless all-to-all), split into Megatron's six phases.

Follows Megatron's `MoEAlltoAllTokenDispatcher` (docs/megatron-rules.md, "Token dispatcher and
expert data parallel"). Dispatch:
    dispatch_preprocess   permute the routed copies of the tokens so they are grouped by global
                          expert (a stable sort, so results do not depend on EP), count rows per
                          expert and, with EP, exchange the counts with the other EP ranks;
    token_dispatch        the all-to-all of the permuted rows (identity without EP);
    dispatch_postprocess  regroup the received rows (source rank, expert) by local expert.
Combine runs the way back:
    combine_preprocess    undo the regrouping;
    token_combine         the reverse all-to-all;
    combine_postprocess   multiply by the routing weight (after the experts' fc2 bias,
                          docs/architecture.md, "Experts") and sum the top-k copies per token.
Routing weights never travel: they are applied on the rank that owns the token.

`dispatch` / `combine` compose the phases for the MoE layer's forward; the schedule plan's nodes
call the phases one by one (model/schedule_plan.py) with its own asynchronous all-to-all
(`start_all_to_all`) between them, so there is one copy of the permutation.

Host synchronisation (counted on CPU by tests/schedule/test_comm_costs.py): counting is a
scatter-add and every data-dependent size is given (`output_size`), so without EP an MoE layer
never waits for the device. With EP the split sizes of the token all-to-all must be host integers,
which is one `.tolist()` of the exchanged counts per MoE layer and microbatch, the budget. Where a
GPU run still blocks the host:
  * that `.tolist()`: the host waits for the count exchange and for everything queued before it
    on the stream (attention, router, permutation), so it cannot queue further kernels meanwhile.
    In the overlap schedule it sits in the `pre_dispatch` node of one microbatch; the other
    microbatch's work queued before it keeps the GPU busy, what follows is queued after it. The
    exchange runs on its own process group (`control_group`, parallel/state.py's
    `ep_control_group`): on the EP group's communicator it would queue behind the other
    microbatch's token all-to-all in flight there, and the `.tolist()` would wait for that too;
  * the per-expert loops (model/gemm/grouped.py for dtypes without `torch._grouped_mm`, e.g. fp32
    on a GPU; fp8/grouped.py for what `torch._scaled_grouped_mm` does not take: MXFP8, e5m2
    gradients, fp32 activations) read the counts once per GEMM; torch's own `_grouped_mm` loops
    on GPUs other than sm90/sm100 and reads them inside the kernel call;
  * once per step, outside the MoE layers: the logged loss totals (the FP8 NaN/inf flag read with
    them, fp8/guard.py) and the gradient norm (clipping, the NaN check). The token count of
    `finalize_model_grads` stays on the device.

Every all-to-all goes through the dispatcher's communication object (`comm`, default `DIST_COMM`:
torch.distributed); benchmarks inject their own (tests/support/simlink.py), the package has no other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gptoss_cli.model.expert_names import ep_slice


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """LongTensor [num_experts] of how often each id occurs; a scatter-add, so no host sync on CUDA
    (bincount must read the maximum back first)."""
    counts = torch.zeros(num_experts, dtype=torch.long, device=expert_ids.device)
    return counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))


# --------------------------------------------------------------------------------------------
# The communication object: who carries the all-to-alls


class Comm(Protocol):
    """What carries the dispatcher's all-to-alls. Training uses `DIST_COMM` (torch.distributed);
    a benchmark may inject another (tests/support/simlink.py wraps it with a simulated link)."""

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor, output_splits: list[int] | None,
                   input_splits: list[int] | None, group: Any, *, control: bool = False) -> None:
        """all_to_all_single of x into out, blocking. control: a few integers (the count exchange)."""

    def start_all_to_all(self, out: torch.Tensor, x: torch.Tensor, output_splits: list[int],
                         input_splits: list[int], group: Any) -> Any:
        """Issue all_to_all_single of x into out; returns the work, whose wait() completes it."""


class DistComm:
    """The all-to-alls of torch.distributed, nothing else: what training runs."""

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor, output_splits: list[int] | None,
                   input_splits: list[int] | None, group: Any, *, control: bool = False) -> None:
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)

    def start_all_to_all(self, out: torch.Tensor, x: torch.Tensor, output_splits: list[int],
                         input_splits: list[int], group: Any) -> Any:
        return dist.all_to_all_single(out, x, output_splits, input_splits, group=group, async_op=True)


DIST_COMM = DistComm()


# --------------------------------------------------------------------------------------------
# The all-to-all, differentiable and asynchronous


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; backward sends the gradients the reverse way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any,
                comm: Comm) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits, ctx.comm = group, output_splits, input_splits, comm
        x = x.contiguous()
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        comm.all_to_all(out, x, output_splits, input_splits, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous()
        out = grad.new_empty((sum(ctx.input_splits),) + tuple(grad.shape[1:]))
        ctx.comm.all_to_all(out, grad, ctx.input_splits, ctx.output_splits, ctx.group)
        return out, None, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any,
               comm: Comm | None = None) -> torch.Tensor:
    """Differentiable variable-size all-to-all over `group` (rows of x split by input_splits), carried
    by `comm` (default: torch.distributed)."""
    return _AllToAll.apply(x, output_splits, input_splits, group, DIST_COMM if comm is None else comm)


class AsyncAllToAll:
    """An all-to-all in flight: `start_all_to_all(...)` issues it, `wait()` returns the received rows.

    The overlap schedule issues the all-to-all of one microbatch, computes another microbatch,
    then waits. gloo runs `async_op=True` collectives on its own threads; on NCCL the collective
    runs on NCCL's stream and `wait()` only makes the current stream wait on it (an event), so the
    host never blocks. Not differentiable: the schedule plan's comm nodes call it in both
    directions themselves; timing it is an observer's job (model/schedule_plan.py).
    """

    def __init__(self, out: torch.Tensor, work: Any):
        self.out, self.work = out, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.out


def start_all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any,
                     comm: Comm | None = None) -> AsyncAllToAll:
    """Issue a variable-size all-to-all without waiting (rows of x split by input_splits)."""
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    if group is None or dist.get_world_size(group) == 1:
        out.copy_(x)
        return AsyncAllToAll(out, None)
    comm = DIST_COMM if comm is None else comm
    return AsyncAllToAll(out, comm.start_all_to_all(out, x, output_splits, input_splits, group))


# --------------------------------------------------------------------------------------------
# The dispatcher

# What a dispatcher must offer for the schedule plan to split an E layer into nodes.
PHASES = ("dispatch_preprocess", "dispatch_postprocess", "combine_preprocess", "combine_postprocess")


@dataclass
class Routing:
    """How one microbatch's (token, choice) pairs are permuted and exchanged. Holds no gradients:
    the routing weights of the permuted rows travel separately (`prob_of_row`), so the schedule
    plan can hand them to the combine node as a differentiable input."""

    num_tokens: int
    token_of_row: torch.Tensor  # [T*k] source token of each permuted row
    tokens_per_expert: torch.Tensor  # [E_local] rows each local expert receives
    input_splits: list[int]  # rows this rank sends to each EP rank
    output_splits: list[int]  # rows this rank receives from each EP rank
    regroup: torch.Tensor | None  # received order (source rank, expert) -> local-expert order; None without EP


class AllToAllTokenDispatcher:
    """Dropless token dispatcher over one EP group (ep_size=1 and no group: every expert is local)."""

    def __init__(self, num_experts: int, ep_size: int = 1, ep_rank: int = 0, ep_group: Any = None,
                 comm: Comm | None = None, control_group: Any = None):
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} not divisible by ep_size={ep_size}")
        self.num_experts = num_experts
        self.ep_size = ep_size if ep_group is not None else 1
        self.ep_rank = ep_rank if ep_group is not None else 0
        self.ep_group = ep_group
        # The count exchange's group: the EP ranks on a communicator of their own (parallel/state.py,
        # ep_control_group), else the EP group itself.
        self.control_group = control_group if control_group is not None else ep_group
        self.comm: Comm = DIST_COMM if comm is None else comm  # carries the all-to-alls (count exchange included)
        held = ep_slice(num_experts, self.ep_size, self.ep_rank)
        self.num_local_experts, self.expert_offset = len(held), held.start

    @property
    def uses_ep(self) -> bool:
        return self.ep_size > 1

    # --- dispatch ---------------------------------------------------------------------------
    def dispatch_preprocess(
        self, hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Routing]:
        """hidden [T, H], probs [T, k], indices [T, k] global expert ids ->
        (permuted rows [T*k, H] by global expert, their routing weights [T*k], Routing)."""
        num_tokens, k = indices.shape
        flat = indices.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        token_of_row = torch.div(order, k, rounding_mode="floor")
        permuted = hidden.index_select(0, token_of_row)
        prob_of_row = probs.reshape(-1)[order]
        counts = expert_counts(flat, self.num_experts)
        rows = int(flat.numel())
        if not self.uses_ep:
            return permuted, prob_of_row, Routing(num_tokens, token_of_row, counts, [rows], [rows], None)
        ep, e_loc = self.ep_size, self.num_local_experts
        send_counts = counts.view(ep, e_loc).contiguous()
        recv_counts = torch.empty_like(send_counts)
        # A few integers, synchronously: row r of recv_counts = rows rank r sends to each of my experts.
        self.comm.all_to_all(recv_counts, send_counts, None, None, self.control_group, control=True)
        splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()  # the one host sync
        received = int(sum(splits[1]))
        # Received rows are ordered (source rank, local expert); regroup to (local expert, source rank).
        local_expert = torch.arange(e_loc, device=hidden.device).repeat(ep)
        local_expert_of_row = torch.repeat_interleave(local_expert, recv_counts.reshape(-1), output_size=received)
        regroup = torch.sort(local_expert_of_row, stable=True).indices
        routing = Routing(num_tokens, token_of_row, recv_counts.sum(0), splits[0], splits[1], regroup)
        return permuted, prob_of_row, routing

    def token_dispatch(self, permuted: torch.Tensor, routing: Routing) -> torch.Tensor:
        if not self.uses_ep:
            return permuted
        return all_to_all(permuted, routing.output_splits, routing.input_splits, self.ep_group, self.comm)

    def dispatch_postprocess(self, received: torch.Tensor, routing: Routing) -> torch.Tensor:
        """-> expert input [N, H] sorted by local expert (counts: routing.tokens_per_expert)."""
        return received if routing.regroup is None else received.index_select(0, routing.regroup)

    # --- combine ----------------------------------------------------------------------------
    def combine_preprocess(self, expert_output: torch.Tensor, routing: Routing) -> torch.Tensor:
        if routing.regroup is None:
            return expert_output
        return expert_output.index_select(0, torch.argsort(routing.regroup))

    def token_combine(self, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
        if not self.uses_ep:
            return rows
        return all_to_all(rows, routing.input_splits, routing.output_splits, self.ep_group, self.comm)

    def combine_postprocess(self, returned: torch.Tensor, prob_of_row: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Routing weight after the fc2 bias, then the sum of the top-k copies per token -> [T, H]."""
        weighted = returned * prob_of_row.to(returned.dtype).unsqueeze(-1)
        out = returned.new_zeros((routing.num_tokens, returned.shape[-1]))
        return out.index_add(0, routing.token_of_row, weighted)

    # --- composed ---------------------------------------------------------------------------
    def dispatch(
        self, hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, Routing]]:
        """-> (expert input [N, H] by local expert, tokens per local expert [E_local], ctx for combine)."""
        permuted, prob_of_row, routing = self.dispatch_preprocess(hidden, probs, indices)
        received = self.token_dispatch(permuted, routing)
        return self.dispatch_postprocess(received, routing), routing.tokens_per_expert, (prob_of_row, routing)

    def combine(self, expert_output: torch.Tensor, ctx: tuple[torch.Tensor, Routing]) -> torch.Tensor:
        prob_of_row, routing = ctx
        rows = self.combine_preprocess(expert_output, routing)
        return self.combine_postprocess(self.token_combine(rows, routing), prob_of_row, routing)


__all__ = ["AllToAllTokenDispatcher", "Routing", "PHASES", "AsyncAllToAll", "Comm", "DistComm", "DIST_COMM",
           "all_to_all", "start_all_to_all", "expert_counts"]
