"""Attention with sinks, whichever kernel computes it: the entry points every attention layer calls
(`sink_attention`, `document_attention`) and the choice among the kernels (`model.attention_backend`).

Three kernels compute the same sink softmax (docs/architecture.md, "Attention and sinks"):
  flash - a flash kernel's output and log-sum-exp, rescaled by the sink (model/attention/sink_flash.py): the CPU's
          kernel takes every layer (masked query blocks); CUDA's takes causal blocks only (full layers);
  flex  - FlexAttention with a block mask for the window and the documents, the sink from its
          log-sum-exp (model/attention/sink_flex.py): compiled on CUDA, its unfused reference on the CPU;
  sdpa  - SDPA with the sink as one more key, head dim padded to a multiple of 8 (model/attention/sink_padded.py):
          every device and dtype; the fallback.

`auto` picks per device and layer (`choose`):
  CPU:  flash (the CPU flash kernel; what the CPU always ran), sdpa for a dtype it lacks;
  CUDA: full-attention layers without packed documents: flash (FlashAttention-2 inside torch: no
        mask to apply, GQA kv heads read as they are, bf16/fp16); sliding-window layers, packed
        documents and fp32: flex, one fused block-sparse kernel; sdpa when FlexAttention cannot
        compile here (TORCH_COMPILE_DISABLE=1, torch < 2.5) or a kernel failed its probe;
  anything else (meta, other accelerators): sdpa.
An explicit choice is honoured or refused (ConfigError, exit 2): `flash` on a layer its kernel does
not take, `flex` without FlexAttention. Before a CUDA kernel is first used for a (device, dtype,
head dim), `auto` probes it once against the sdpa path on a small problem, forward and every
gradient (`kernel_works`): an error or a wrong answer gives one warning and the next kernel, never
a crash, as model/swiglu_kernel.py does for the SwiGLU.
"""

from __future__ import annotations

import threading
import warnings

import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.attention import sink_flash, sink_flex
from gptoss_cli.model.attention.masks import query_blocks
from gptoss_cli.model.catalog import ATTENTION_BACKENDS
from gptoss_cli.model.attention.sink_padded import padded_sink_attention

KERNELS = ("flash", "flex", "sdpa")  # what a backend resolves to for one layer


def check_backend(name: str) -> str:
    """`name` if it is one of ATTENTION_BACKENDS, else a ConfigError naming the choices."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"model.attention_backend {name!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    return name


def choose(backend: str, q: torch.Tensor, window: int | None, documents: bool = False) -> str:
    """The kernel ("flash", "flex" or "sdpa") that computes a layer's attention for q [B, h, S, d] on
    its device: `backend` is the recipe's choice, `window` the layer's, `documents` whether packed
    documents are given (see the module docstring)."""
    check_backend(backend)
    causal = window is None or window >= q.shape[2]
    if backend == "sdpa":
        return "sdpa"
    if backend == "flash":
        if not sink_flash.available(q):
            raise ConfigError(f"model.attention_backend=flash: no flash kernel computes {q.dtype} on {q.device.type} "
                              f"at head dim {q.shape[-1]}", hint="use auto, flex or sdpa")
        if not causal and not sink_flash.takes_masks(q):
            raise ConfigError(f"model.attention_backend=flash: the {q.device.type} flash kernel takes no mask, so it "
                              f"cannot compute a sliding-window layer (window {window})",
                              hint="use auto (FlexAttention on those layers) or flex")
        return "flash"
    if backend == "flex":
        if not sink_flex.available():
            raise ConfigError(f"model.attention_backend=flex needs FlexAttention (torch >= 2.5); this is torch "
                              f"{torch.__version__}", hint="use auto or sdpa")
        return "flex"
    device = q.device.type
    if device == "cpu":
        return "flash" if sink_flash.available(q) else "sdpa"
    if device == "cuda":
        if causal and not documents and sink_flash.available(q) and kernel_works("flash", q):
            return "flash"
        if sink_flex.available() and sink_flex.compiles(q.device) and kernel_works("flex", q):
            return "flex"
    return "sdpa"


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int | None,
                   backend: str = "auto") -> torch.Tensor:
    """Attention with one sink logit per query head, one sequence per row.

    q [B, heads, S, d], k/v [B, kv_heads, S, d], sinks [heads] -> [B, heads, S, d]. Query head h
    reads kv head h // (heads/kv_heads) (SDPA's enable_gqa grouping). `backend`: see `choose`."""
    return _run(choose(backend, q, window), q, k, v, sinks, window, None)


def _run(kernel: str, q, k, v, sinks, window: int | None, cu_seqlens: tuple[int, ...] | None) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5
    if kernel == "flash":
        blocks = query_blocks(q.shape[2], window, q.device, q.dtype)
        return sink_flash.sink_flash_attention(q, k, v, sinks, blocks, scale)
    if kernel == "flex":
        return sink_flex.sink_flex_attention(q, k, v, sinks, window, cu_seqlens, scale)
    return padded_sink_attention(q, k, v, sinks, window)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                       window: int | None, cu_seqlens: tuple[int, ...] | None, backend: str = "auto") -> torch.Tensor:
    """`sink_attention` within documents: no query sees a key of another document.

    cu_seqlens: document start offsets into the flattened [B*S] token stream, 0 .. B*S, that include
    every row start (b*S) (flash-attn's varlen convention; model/positions.py's `document_offsets`
    builds them); None = one document per row. Sinks and the sliding window apply within each
    document: FlexAttention takes all documents in one block mask, the other kernels run each
    document alone."""
    if cu_seqlens is None:
        return sink_attention(q, k, v, sinks, window, backend)
    b, nh, s, d = q.shape
    nkv = k.shape[1]
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != b * s:
        raise ValueError(f"cu_seqlens must run from 0 to batch x seq = {b * s}, got {cu_seqlens[0]} .. {cu_seqlens[-1]}")
    for start, stop in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if start // s != (stop - 1) // s:
            raise ValueError(f"document [{start}, {stop}) crosses a row boundary (rows of {s} tokens)")
    kernel = choose(backend, q, window, documents=True)
    if kernel == "flex":
        return _run(kernel, q, k, v, sinks, window, cu_seqlens)
    # [B, h, S, d] -> [h, B*S, d]: one token stream, documents are slices of it.
    flat_q = q.transpose(0, 1).reshape(nh, b * s, d)
    flat_k = k.transpose(0, 1).reshape(nkv, b * s, d)
    flat_v = v.transpose(0, 1).reshape(nkv, b * s, d)
    outs = []
    for start, stop in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        outs.append(sink_attention(flat_q[None, :, start:stop], flat_k[None, :, start:stop],
                                   flat_v[None, :, start:stop], sinks, window, kernel)[0])
    return torch.cat(outs, dim=1).view(nh, b, s, d).transpose(0, 1)


# --- what each kernel is, and whether it works here -----------------------------------------------
def describe(kernel: str, device: torch.device | str) -> str:
    """One line naming what computes a layer with `kernel` on `device` (doctor, tools/gpu_check.py)."""
    kind = torch.device(device).type
    if kernel == "flash":
        return "CPU flash kernel + sink from its log-sum-exp" if kind == "cpu" else \
            f"{kind} flash kernel (FlashAttention-2) + sink from its log-sum-exp"
    if kernel == "flex":
        how = "compiled, fused block-sparse" if sink_flex.compiles(torch.device(device)) else "unfused reference"
        return f"FlexAttention ({how}) + sink from its log-sum-exp"
    return "SDPA with the sink as an extra key (head dim padded to a multiple of 8)"


def layer_kernels(backend: str, device: torch.device | str, dtype: torch.dtype, head_dim: int, seq: int,
                  window: int | None, documents: bool = False) -> dict[str, str]:
    """{"full": kernel, "sliding": kernel}: what `backend` gives a full-attention and a sliding-window
    layer at `seq` tokens (probing CUDA kernels as a forward would)."""
    q = torch.empty(1, 1, seq, head_dim, device=device, dtype=dtype)
    return {"full": choose(backend, q, None, documents), "sliding": choose(backend, q, window, documents)}


def warm_up(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Probe the CUDA kernels `auto` may pick for this device, dtype and head dim now (HybridModel.
    set_attention_backend calls it), not inside the first training forward."""
    if device.type != "cuda":
        return
    q = torch.empty(1, 1, 1, head_dim, device=device, dtype=dtype)
    if sink_flash.available(q):
        kernel_works("flash", q)
    if sink_flex.available() and sink_flex.compiles(device):
        kernel_works("flex", q)


_verdicts: dict[tuple[str, str, torch.dtype, int], bool] = {}
_lock = threading.Lock()


def kernel_works(kernel: str, q: torch.Tensor) -> bool:
    """Whether `kernel` computes the sink softmax right on q's device, dtype and head dim, judged once
    (then cached) against the sdpa path on a small problem: forward, and the gradients of q, k, v and
    the sinks. A failure warns once and answers False for good."""
    key = (kernel, q.device.type, q.dtype, q.shape[-1])
    verdict = _verdicts.get(key)
    if verdict is not None:
        return verdict
    with _lock:
        if key not in _verdicts:
            _verdicts[key] = _probe(kernel, q.device, q.dtype, q.shape[-1])
        return _verdicts[key]


def _probe(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    # 2 rows of 192 tokens (FlexAttention's blocks are 128), 4 query heads on 2 kv heads; flex with a
    # window and 3 documents, flash causal (what auto gives each).
    b, h, kv, s = 2, 4, 2, 192
    window, cu = (48, (0, 100, 192, 300, 384)) if kernel == "flex" else (None, None)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(b, n, s, head_dim, generator=gen).to(device=device, dtype=dtype) for n in (h, kv, kv)]
    inputs.append(torch.randn(h, generator=gen).to(device=device, dtype=dtype))
    grad = torch.randn(b, h, s, head_dim, generator=gen).to(device=device, dtype=dtype)
    try:
        # identity hooks: an enclosing activation checkpoint must not pack the probe's saved tensors
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            got = _forward_backward(lambda *t: _run(kernel, *t, window, cu), inputs, grad)
            want = _forward_backward(lambda *t: document_attention(*t, window, cu, "sdpa"),
                                     [t.float() for t in inputs], grad.float())
    except Exception as exc:  # noqa: BLE001 - any kernel failure means: use the next kernel
        reason = (str(exc).strip().splitlines() or [""])[0][:160]
        warnings.warn(f"attention kernel {kernel} unavailable on {device.type} {dtype} ({type(exc).__name__}: "
                      f"{reason}); auto uses the next one", stacklevel=4)
        return False
    # A generous bound (a wrong mask or a lost sink gradient misses by whole units): bf16/fp16 inputs
    # round every product to 8 or 11 bits; tests/model/test_attention_backends.py holds the tight bounds.
    tol = 0.05 if dtype in (torch.bfloat16, torch.float16) else 1e-3
    for name, a, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        if not torch.allclose(a.float(), w, rtol=tol, atol=tol * float(w.abs().max())):
            warnings.warn(f"attention kernel {kernel} disagrees with sdpa on {device.type} {dtype} ({name}); "
                          "auto uses the next one", stacklevel=4)
            return False
    return True


def _forward_backward(fn, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad)
    return [out.detach().float(), *(g.float() for g in grads)]


__all__ = ["KERNELS", "check_backend", "choose", "sink_attention", "document_attention", "describe", "layer_kernels",
           "kernel_works", "warm_up"]
