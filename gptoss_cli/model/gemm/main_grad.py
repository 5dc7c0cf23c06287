"""Weight gradients added by their own kernel straight into the training buffers' `main_grad` (Megatron's gradient-accumulation fusion).

The training buffers (gptoss_cli/parallel/grads.py) give every trained parameter a `main_grad`, a
view of the flat fp32 gradient buffer, and add each backward's `.grad` into it from a
post-accumulate-grad hook: the weight-gradient GEMM writes a fresh tensor as large as the weight,
then the hook reads it and main_grad and writes main_grad again. For the large weights (the
experts', the output layer's, the embedding's) a backward can instead accumulate into main_grad itself (a GEMM with
beta = 1, per expert) and hand autograd a stand-in: `added_to_main_grad(param)` returns an
uninitialised tensor of the parameter's shape (never read, never filled) and remembers it; the
hook asks `take_added(param, grad)` whether the gradient it received is that stand-in and, if so,
skips its add. A parameter used twice in one graph would receive the stand-in summed with another
gradient: `take_added` reports that as an error instead of adding garbage. Only `backward()`
(which runs the hook) may follow: `torch.autograd.grad` with respect to such a parameter would
return the stand-in, so nothing in the library asks for one (the training buffers are only built
for `backward()` training).

`main_grad_target(param)` says where a backward may accumulate: where both the parameter and
main_grad are fp32 (fp32 training, on the CPU or a GPU), and where a bf16/fp16 parameter has an
fp32 main_grad on a device whose GEMMs sum bf16 products into an fp32 output themselves
(`fp32_accumulating_gemm`: CUDA, torch 2.10+, `torch.addmm(..., out_dtype=torch.float32)` with an
fp32 `self`, pytorch/pytorch#167931). There the gradient is never rounded to bf16 on its way into
main_grad; `addmm_fp32_` / `mm_fp32` are those GEMMs (elsewhere the same sums, with the operands
upcast first: a product of two bf16 values is exact in fp32). Elsewhere bf16 parameters keep the
unfused path and its rounding: a bf16 gradient added into an fp32 main_grad, or summed in a bf16
one (`grad_reduce_in_fp32=false`, tests/train/test_grad_reduce_dtype.py). Without the buffers
(inference, plain autograd) it is None and the backward returns the gradient as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

from gptoss_cli.errors import TrainingError

_STAND_IN = "_grad_added_to_main_grad"  # the data_ptr of the stand-in handed to autograd, until the hook takes it


# torch.addmm / torch.mm with `out_dtype=torch.float32` for bf16 operands and an fp32 `self`
# (CUDA kernels only; the fp32 `self` since torch 2.10).
_HAS_FP32_ADDMM = TorchVersion(torch.__version__) >= "2.10"


def fp32_accumulating_gemm(device: torch.device) -> bool:
    """Whether GEMMs on `device` add bf16/fp16 products into an fp32 output in one kernel."""
    return device.type == "cuda" and _HAS_FP32_ADDMM


def addmm_fp32_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out (fp32) += a @ b, the products summed in fp32 by the GEMM (no rounded copy of a @ b)."""
    if a.dtype == out.dtype:
        return out.addmm_(a, b)
    if out.is_cuda:
        return torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    return out.addmm_(a.to(out.dtype), b.to(out.dtype))


def mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b in fp32 for bf16/fp16 operands, summed in fp32 by the GEMM and returned unrounded
    (into `out`, fp32, when given)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)


# Elements per block of `add_cast_`: its fp32 temporary (4 MiB) stays below glibc's mmap threshold.
ADD_CAST_BLOCK = 1 << 20


def add_cast_(target: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """target += grad. A CPU add of another dtype (a bf16 gradient into an fp32 main_grad) casts its operand
    into a temporary as large as it first: a [vocabulary, hidden] gradient's is far above glibc's mmap
    threshold, mapped and faulted in afresh at every add (12,600 minor faults at 201,088 x 64), so it goes in
    blocks of ADD_CAST_BLOCK elements, whose temporaries the heap serves again (the same sums)."""
    if (target.dtype == grad.dtype or target.device.type != "cpu" or target.numel() <= ADD_CAST_BLOCK
            or not (target.is_contiguous() and grad.is_contiguous()) or target.shape != grad.shape):
        return target.add_(grad)
    flat_t, flat_g = target.view(-1), grad.view(-1)
    for start in range(0, flat_t.numel(), ADD_CAST_BLOCK):
        flat_t[start:start + ADD_CAST_BLOCK].add_(flat_g[start:start + ADD_CAST_BLOCK])
    return target


def main_grad_target(param: torch.Tensor) -> torch.Tensor | None:
    """param.main_grad when a backward may add the parameter's gradient into it itself, else None."""
    main = getattr(param, "main_grad", None)
    if main is None or not param.requires_grad or main.shape != param.shape or main.dtype != torch.float32:
        return None
    if param.dtype == torch.float32:
        return main
    if param.dtype in (torch.bfloat16, torch.float16) and fp32_accumulating_gemm(main.device):
        return main
    return None


def added_to_main_grad(param: torch.Tensor) -> torch.Tensor:
    """The gradient a backward returns for `param` after adding the real one into main_grad: an
    uninitialised stand-in of the parameter's shape that the buffers' hook discards (`take_added`)."""
    stand_in = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    setattr(param, _STAND_IN, stand_in.data_ptr())
    return stand_in


def take_added(param: torch.Tensor, grad: torch.Tensor | None) -> bool:
    """In the accumulation hook: True when `grad` is the stand-in of `added_to_main_grad` (main_grad
    already holds this backward's gradient), False for an ordinary gradient to add."""
    ptr = getattr(param, _STAND_IN, None)
    if ptr is None:
        return False
    delattr(param, _STAND_IN)
    if grad is not None and grad.data_ptr() == ptr:
        return True
    raise TrainingError(
        f"a gradient of shape {tuple(param.shape)} that its backward added straight into main_grad reached "
        "the accumulation hook combined with another gradient of the same parameter (is it used twice in the graph?)",
        hint="report this as a bug: the fused weight-gradient path assumes one use per parameter and backward",
    )


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    """F.embedding whose backward index-adds the rows' gradients into the weight's main_grad: no
    zero-filled [vocab, hidden] gradient (the native backward's) for the buffers' hook to add."""

    @staticmethod
    def forward(ctx, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(input_ids)
        ctx.weight = weight
        return F.embedding(input_ids, weight)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (input_ids,) = ctx.saved_tensors
        weight, ctx.weight = ctx.weight, None
        rows, ids = dy.reshape(-1, dy.shape[-1]), input_ids.reshape(-1)
        target = main_grad_target(weight)
        if target is None:  # the buffers went away between forward and backward
            return None, torch.zeros_like(weight).index_add_(0, ids, rows.to(weight.dtype))
        target.index_add_(0, ids, rows.to(target.dtype))
        return None, added_to_main_grad(weight)


def embedding(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.embedding(input_ids, weight)`; in training with fp32 buffers its weight gradient goes
    straight into main_grad."""
    if torch.is_grad_enabled() and main_grad_target(weight) is not None:
        return _EmbeddingIntoMainGrad.apply(input_ids, weight)
    return F.embedding(input_ids, weight)


__all__ = ["ADD_CAST_BLOCK", "add_cast_", "embedding", "added_to_main_grad", "main_grad_target", "take_added",
           "fp32_accumulating_gemm", "addmm_fp32_", "mm_fp32"]
