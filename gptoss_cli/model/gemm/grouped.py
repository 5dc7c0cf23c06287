"""The experts' grouped linear layer: one GEMM path for forward, input gradient and weight gradient.

Rows of `x [N, in]` are sorted by local expert and `tokens_per_expert [E]` says how many rows each
expert owns; `weight [E, out, in]`, `bias [E, out]`. The three GEMMs of the layer are

    fprop  y_e  = x_e @ W_e^T          (+ b_e, added outside the GEMM)
    dgrad  dx_e = dy_e @ W_e
    wgrad  dW_e = dy_e^T @ x_e,  db_e = sum over the rows of dy_e

and `GroupedGemm` computes them: `torch._grouped_mm` where it takes the operands (CPU fp32/bf16,
CUDA bf16: torch's grouped kernel on sm90/sm100, torch's own loop elsewhere), else a loop over the
experts (never over tokens). A `torch._grouped_mm` error stops the run naming the GEMM: never a
silent switch to the loop for the rest of the run. Low-precision recipes (FP8)
provide the same three methods with other numerics; the autograd functions below do not change.
Biases are added in the activation dtype outside the GEMM, so padding rows that a kernel may add
never receive one; their gradients are summed in fp32 and rounded once (`_bias_grad`).

`grouped_linear(..., wgrad_queue=q)` is the delayed-wgrad form (docs/megatron-rules.md, "Delayed
weight gradients"): backward computes dx at once and queues (x, dy); `q.execute()` later runs
the wgrad GEMMs and accumulates into the parameters. `WgradQueue.finish_step()` raises when work
is left, so a schedule that forgot to run it fails instead of training on missing gradients.

`frozen_grouped_linear` is the form for a frozen weight kept in another storage (MXFP4 blocks and
scales, model/mxfp4/experts.py): `make_weight()` builds the weight for the fprop GEMM and again for
the dgrad GEMM, and nothing keeps it in between, so at most one layer's weight exists at a time.
There is no wgrad, so nothing is queued under delayed wgrad either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from gptoss_cli import torch_private
from gptoss_cli.errors import TrainingError
from gptoss_cli.model import host_reads
from gptoss_cli.model.gemm.main_grad import added_to_main_grad, main_grad_target, mm_fp32


def _grouped_mm_usable(a: torch.Tensor, b_shape: tuple[int, ...]) -> bool:
    """Whether torch._grouped_mm takes these operands: CPU fp32/bf16, CUDA bf16 (torch runs its fast
    kernel on sm90/sm100 and its own per-group loop elsewhere), every row stride a multiple of 16 bytes."""
    if not torch_private.has_grouped_mm() or a.dtype not in (torch.float32, torch.bfloat16):
        return False
    if a.is_cuda and a.dtype != torch.bfloat16:
        return False  # the CUDA grouped kernel is bf16-only
    if not (a.is_cuda or a.device.type == "cpu"):
        return False
    align = 16 // a.element_size()
    return all(d % align == 0 for d in b_shape[-2:])


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, what: str) -> torch.Tensor:
    """torch._grouped_mm. `_grouped_mm_usable` has already excluded every operand it documents as
    unsupported, so an error here is a bug or a failing device, which a loop over the experts would
    only hide (and run slower for the rest of the run): it stops the run with the GEMM's shapes and
    torch's reason. Out-of-memory passes through unchanged."""
    try:
        return torch_private.grouped_mm(a, b, offsets)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:
        raise TrainingError(
            f"torch._grouped_mm failed for the experts' {what} GEMM ({list(a.shape)} x {list(b.shape)}, "
            f"{str(a.dtype).removeprefix('torch.')}, {a.device}): {(str(exc).strip().splitlines() or [''])[0][:200]}",
            hint="report it with these shapes and the torch version (the per-expert loop is no silent fallback)",
        ) from None


def expert_of_row(tokens_per_expert: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[N] local expert index of every row (no host sync: the output size is given)."""
    experts = torch.arange(tokens_per_expert.numel(), device=tokens_per_expert.device)
    return torch.repeat_interleave(experts, tokens_per_expert, output_size=num_rows)


class GroupedGemm:
    """The three GEMMs of a grouped linear layer in the operands' own dtype."""

    name = "default"

    def fprop(self, x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:  # no rows (a rank that received no tokens): nothing to read or compute
            return x.new_zeros(0, weight.shape[1])
        if _grouped_mm_usable(x, weight.shape):
            return _grouped_mm(x, weight.transpose(-2, -1), _offsets(tokens_per_expert), "fprop")
        return map_experts(x, tokens_per_expert.tolist(), lambda e, rows: rows @ weight[e].t(), weight.shape[1])

    def dgrad(self, dy: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if dy.shape[0] == 0:
            return dy.new_zeros(0, weight.shape[2])
        if _grouped_mm_usable(dy, weight.shape):
            return _grouped_mm(dy, weight, _offsets(tokens_per_expert), "dgrad")
        return map_experts(dy, tokens_per_expert.tolist(), lambda e, rows: rows @ weight[e], weight.shape[2])

    def wgrad(self, x: torch.Tensor, dy: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        num_experts = tokens_per_expert.numel()
        if x.shape[0] == 0:
            return dy.new_zeros(num_experts, dy.shape[1], x.shape[1])
        if _grouped_mm_usable(x, (num_experts, dy.shape[1], x.shape[1])):
            return _grouped_mm(dy.t(), x, _offsets(tokens_per_expert), "wgrad")
        counts = tokens_per_expert.tolist()
        grads = [d.t() @ xe for d, xe in zip(torch.split(dy, counts), torch.split(x, counts))]
        return torch.stack(grads) if grads else dy.new_zeros(0, dy.shape[1], x.shape[1])

    def wgrad_accumulate(self, x: torch.Tensor, dy: torch.Tensor, tokens_per_expert: torch.Tensor,
                         out: torch.Tensor) -> bool:
        """out [E, out, in] += wgrad(x, dy, tokens_per_expert) by one accumulating GEMM (beta = 1) per
        expert, with no [E, out, in] temporary and no separate add; True when done. Only where the
        counts are on the host (the CPU: no device sync; the CUDA grouped kernel writes a fresh
        tensor and stays as it is) and the dtypes agree; False, with nothing done, elsewhere and for
        GEMMs with numerics of their own (FP8), which then take `wgrad`."""
        if type(self).wgrad is not GroupedGemm.wgrad or not host_reads.free(x.device):
            return False
        if not (x.dtype == dy.dtype == out.dtype) or out.shape != (tokens_per_expert.numel(), dy.shape[1], x.shape[1]):
            return False
        counts = tokens_per_expert.tolist()
        for e, (d, xe) in enumerate(zip(torch.split(dy, counts), torch.split(x, counts))):
            if d.shape[0]:
                out[e].addmm_(d.t(), xe)
        return True


DEFAULT_GEMM = GroupedGemm()


def _offsets(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(tokens_per_expert, 0).to(torch.int32)


def map_experts(rows: torch.Tensor, counts: list[int], fn, out_features: int) -> torch.Tensor:
    """fn(e, expert e's rows) for every expert, concatenated (`counts` on the host, read once by the caller)."""
    outs = [fn(e, chunk) for e, chunk in enumerate(torch.split(rows, counts))]
    return torch.cat(outs) if outs else rows.new_zeros(0, out_features)


def _add_bias(y: torch.Tensor, bias: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """y [N, out] (the GEMM's own output) + each row's expert bias.

    On the CPU, where reading the counts costs no device sync, in place one expert's rows at a
    time (no [N, out] tensor of repeated biases, one pass over y instead of three); elsewhere the
    repeats are materialised, which needs no host read of the counts."""
    bias = bias.to(y.dtype)
    if host_reads.free(y.device):
        for rows, b in zip(torch.split(y, tokens_per_expert.tolist()), bias):
            rows.add_(b)
        return y
    return y + torch.repeat_interleave(bias, tokens_per_expert, dim=0, output_size=y.shape[0])


def _bias_grad(dy: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """db [E, out]: the sum of each expert's rows of dy, in fp32 and rounded once to dy's dtype.

    On the CPU a column sum per expert (the counts are on the host). Elsewhere, without a host read
    of the counts: one GEMM of the rows' one-hot expert ids against dy, which sums the products in
    fp32 (`mm_fp32`; a one-hot product is exact) in a fixed order. The index_add_ it replaces rounded
    after every add in dy's dtype (bf16 atomics on a GPU, in no fixed order): 11-32x the error
    (tests/model/test_expert_bias_grad.py)."""
    if host_reads.free(dy.device):
        sums = [rows.sum(0) for rows in torch.split(dy, tokens_per_expert.tolist())]
        return torch.stack(sums) if sums else dy.new_zeros(0, dy.shape[1])
    rows = expert_of_row(tokens_per_expert, dy.shape[0])
    one_hot = dy.new_zeros(dy.shape[0], tokens_per_expert.numel()).scatter_(1, rows.unsqueeze(1), 1.0)
    return mm_fp32(one_hot.t(), dy).to(dy.dtype)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                tokens_per_expert: torch.Tensor, gemm: GroupedGemm) -> torch.Tensor:
        ctx.save_for_backward(x, weight, tokens_per_expert)
        ctx.gemm = gemm
        return _add_bias(gemm.fprop(x, weight, tokens_per_expert), bias, tokens_per_expert)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x, weight, tokens_per_expert = ctx.saved_tensors
        dy = dy.contiguous()
        dx = ctx.gemm.dgrad(dy, weight, tokens_per_expert) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            # In training, straight into the buffers' main_grad where the GEMM can accumulate there
            # (model/gemm/main_grad.py); else a fresh gradient for autograd and the buffers' hook.
            target = main_grad_target(weight)
            if target is not None and ctx.gemm.wgrad_accumulate(x, dy, tokens_per_expert, target):
                dw = added_to_main_grad(weight)
            else:
                dw = ctx.gemm.wgrad(x, dy, tokens_per_expert).to(weight.dtype)
        db = _bias_grad(dy, tokens_per_expert) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


@dataclass
class _Pending:
    weight: torch.Tensor
    bias: torch.Tensor
    x: torch.Tensor
    dy: torch.Tensor
    tokens_per_expert: torch.Tensor
    gemm: GroupedGemm
    name: str


class WgradQueue:
    """FIFO of weight-gradient GEMMs deferred from backward (one per step, shared by the layers)."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []
        self.executed = 0  # GEMM pairs run since construction (tests and the bench read it)

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, item: _Pending) -> None:
        self._pending.append(item)

    def execute(self) -> int:
        """Run every queued wgrad now, accumulating into the parameters; returns how many."""
        n = 0
        while self._pending:
            p = self._pending.pop(0)
            if p.weight.requires_grad:
                target = main_grad_target(p.weight)
                if target is None or not p.gemm.wgrad_accumulate(p.x, p.dy, p.tokens_per_expert, target):
                    _accumulate_grad(p.weight, p.gemm.wgrad(p.x, p.dy, p.tokens_per_expert))
            if p.bias.requires_grad:  # a LoRA factor's stand-in zero bias has none
                _accumulate_grad(p.bias, _bias_grad(p.dy, p.tokens_per_expert))
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


def _accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """What autograd plus the training buffers' post-accumulate hook would have done with `grad`."""
    main = getattr(param, "main_grad", None)
    if main is not None:
        main.add_(grad)
    elif param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


class _DelayedWgradGroupedLinear(torch.autograd.Function):
    """Backward returns only dx and queues (x, dy) for dW and db.

    The parameters reach the Function inside a tuple, not as tensor inputs: autograd then has no
    gradient edge to them at all (returning None for a parameter input would still fire its
    post-accumulate hook with no gradient). The queue accumulates their gradients instead. An
    input that needs no gradient (LoRA's low-rank path under QAT reads a detached input) would
    leave the output outside the graph and backward would never queue the weight gradients:
    `anchor`, a scalar leaf that requires grad, keeps it inside (it gets no gradient, nor does x)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, params: tuple[torch.Tensor, torch.Tensor], tokens_per_expert: torch.Tensor,
                gemm: GroupedGemm, queue: WgradQueue, name: str, anchor: torch.Tensor | None = None) -> torch.Tensor:
        weight, bias = params
        ctx.save_for_backward(x, tokens_per_expert)
        ctx.params, ctx.gemm, ctx.queue, ctx.name = params, gemm, queue, name
        return _add_bias(gemm.fprop(x, weight.detach(), tokens_per_expert), bias.detach(), tokens_per_expert)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x, tokens_per_expert = ctx.saved_tensors
        weight, bias = ctx.params
        dy = dy.contiguous()
        dx = ctx.gemm.dgrad(dy, weight.detach(), tokens_per_expert) if ctx.needs_input_grad[0] else None
        if weight.requires_grad or bias.requires_grad:
            ctx.queue.push(_Pending(weight, bias, x.detach(), dy, tokens_per_expert, ctx.gemm, ctx.name))
        return dx, None, None, None, None, None, None


# `_DelayedWgradGroupedLinear`'s anchor: a leaf that requires grad and never receives one.
_ANCHOR = torch.zeros((), requires_grad=True)


class _FrozenWeightGroupedLinear(torch.autograd.Function):
    """fprop and dgrad on a weight built on demand by `make_weight()` (twice: it is never saved); the
    weight has no gradient. The bias's gradient, if it wants one, is computed at once."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor, tokens_per_expert: torch.Tensor,
                make_weight: Callable[[], torch.Tensor], gemm: GroupedGemm) -> torch.Tensor:
        ctx.save_for_backward(tokens_per_expert)
        ctx.make_weight, ctx.gemm = make_weight, gemm
        return _add_bias(gemm.fprop(x, make_weight(), tokens_per_expert), bias.detach(), tokens_per_expert)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        (tokens_per_expert,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = ctx.gemm.dgrad(dy, ctx.make_weight(), tokens_per_expert) if ctx.needs_input_grad[0] else None
        db = _bias_grad(dy, tokens_per_expert) if ctx.needs_input_grad[1] else None
        return dx, db, None, None, None


def frozen_grouped_linear(
    x: torch.Tensor,
    make_weight: Callable[[], torch.Tensor],
    bias: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    gemm: GroupedGemm | None = None,
) -> torch.Tensor:
    """`grouped_linear` for a frozen weight `[E, out, in]` that `make_weight()` builds for each GEMM
    (fprop, then dgrad in backward) and that is dropped after it: no wgrad, nothing saved but the counts."""
    gemm = gemm or DEFAULT_GEMM
    if not torch.is_grad_enabled():
        return _add_bias(gemm.fprop(x, make_weight(), tokens_per_expert), bias, tokens_per_expert)
    return _FrozenWeightGroupedLinear.apply(x, bias, tokens_per_expert, make_weight, gemm)


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    gemm: GroupedGemm | None = None,
    wgrad_queue: WgradQueue | None = None,
    name: str = "expert linear",
) -> torch.Tensor:
    """Rows of x sorted by expert -> `[N, out]`; with `wgrad_queue`, dW and db wait in the queue."""
    gemm = gemm or DEFAULT_GEMM
    if wgrad_queue is not None and torch.is_grad_enabled():
        anchor = _ANCHOR if not x.requires_grad and (weight.requires_grad or bias.requires_grad) else None
        return _DelayedWgradGroupedLinear.apply(x, (weight, bias), tokens_per_expert, gemm, wgrad_queue, name, anchor)
    if not torch.is_grad_enabled():
        return _add_bias(gemm.fprop(x, weight, tokens_per_expert), bias, tokens_per_expert)
    return _GroupedLinear.apply(x, weight, bias, tokens_per_expert, gemm)


__all__ = ["GroupedGemm", "DEFAULT_GEMM", "WgradQueue", "grouped_linear", "frozen_grouped_linear", "expert_of_row", "map_experts"]
