"""Scratch buffers for the LM head's [tokens x vocabulary] chunks, kept and reused on the CPU.

The chunked LM head (the loss, model/loss.py; log-probabilities, model/head_log_probs.py; the next
token's logits in decoding, model/decode/kv_cache.py and rl/sampling.py) computes, per chunk of
tokens, tensors as large as the chunk times the vocabulary: 206 MB for 256 tokens of GPT-OSS's
201,088 in fp32. On a GPU the caching allocator hands the same blocks back chunk after chunk. On
the CPU every such tensor is a fresh glibc allocation above its mmap threshold: mapped, faulted in
page by page by the kernel, and unmapped when freed, chunk after chunk and step after step (a
2-layer GRPO step at that vocabulary spent as much time in the kernel as in its own code, 4 million
minor faults a step; issue 55). `buffer(slot, shape, dtype, device)` instead hands out a view of a
buffer kept for the slot: the first request maps and faults it in, later ones reuse its pages.

The contract that keeps reuse safe: a slot's buffer is scratch inside one call. No tensor handed to
the caller, and no tensor autograd saves for backward, is ever a view of it (the chunked functions
return fresh per-token tensors and save only their inputs, recomputing the chunk in backward), so
the next chunk, step or call may overwrite it. tests/model/test_workspace.py checks both sides of
that: results bit for bit equal with and without reuse, and no saved tensor on a buffer's storage.

A slot's buffer only grows (the largest request so far, a smaller one is a view of its head), so
the kept memory is a few chunks of the largest vocabulary seen; `release()` drops them.

A tensor held past the call (the chunked loss's output-layer gradient, computed in forward and
added into main_grad in backward) is `borrow`ed instead and handed back with `give_back` by its
holder once nothing refers to it; up to KEEP_RETURNED of each shape wait for the next borrower. One
never handed back (a graph dropped before its backward) is simply freed.

Reuse is on for CPU tensors only, per thread, unless `GPTOSS_LM_HEAD_BUFFERS=fresh` is set (each
request a fresh tensor, as before issue 55: what the benches' before/after rows compare).
"""

from __future__ import annotations

import math
import os
import threading

import torch

# The environment variable that turns reuse off (value "fresh"); the benches set it for their "before" rows.
BUFFERS_ENV = "GPTOSS_LM_HEAD_BUFFERS"

_local = threading.local()


def reusing(device: torch.device) -> bool:
    """Whether `buffer` keeps and reuses buffers on `device`: the CPU's, unless GPTOSS_LM_HEAD_BUFFERS=fresh."""
    return device.type == "cpu" and os.environ.get(BUFFERS_ENV, "reuse") != "fresh"


def _kept() -> dict[tuple[str, torch.dtype, torch.device], torch.Tensor]:
    kept = getattr(_local, "kept", None)
    if kept is None:
        kept = _local.kept = {}
    return kept


def buffer(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous tensor of `shape` for scratch use within one call (module docstring):
    on the CPU a view of the slot's kept buffer, elsewhere (or with reuse off) a fresh tensor."""
    device = torch.device(device)
    if not reusing(device):
        return torch.empty(shape, dtype=dtype, device=device)
    n = math.prod(shape)
    kept = _kept()
    key = (slot, dtype, device)
    flat = kept.get(key)
    if flat is None or flat.numel() < n:
        kept.pop(key, None)  # the smaller one is freed before the larger one is mapped
        flat = kept[key] = torch.empty(n, dtype=dtype, device=device)
    return flat[:n].view(shape)


# Handed-back tensors kept per (shape, dtype, device): the microbatches whose gradients are in flight at once.
KEEP_RETURNED = 2


def _returned() -> dict[tuple, list[torch.Tensor]]:
    returned = getattr(_local, "returned", None)
    if returned is None:
        returned = _local.returned = {}
    return returned


def borrow(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of `shape` that the caller may hold past the call and hands back with
    `give_back` (on the CPU, one handed back before, when there is one)."""
    device = torch.device(device)
    waiting = _returned().get((tuple(shape), dtype, device)) if reusing(device) else None
    return waiting.pop() if waiting else torch.empty(shape, dtype=dtype, device=device)


def give_back(tensor: torch.Tensor) -> None:
    """Hand a `borrow`ed tensor back: the caller holds no reference that it will read again, and nothing else
    holds one at all (not autograd, not a returned view)."""
    if not reusing(tensor.device):
        return
    waiting = _returned().setdefault((tuple(tensor.shape), tensor.dtype, tensor.device), [])
    if len(waiting) < KEEP_RETURNED:
        waiting.append(tensor)


def kept_bytes() -> int:
    """The bytes this thread's kept buffers and handed-back tensors hold."""
    held = [*_kept().values(), *(t for ts in _returned().values() for t in ts)]
    return sum(t.numel() * t.element_size() for t in held)


def kept_storages() -> set[int]:
    """The data pointers of this thread's kept buffers (what no saved tensor may point into)."""
    return {t.untyped_storage().data_ptr() for t in _kept().values()}


def fill_kept(value: float) -> None:
    """Write `value` into every kept buffer and handed-back tensor of this thread: what a computation that
    read a buffer before writing it (or after the next chunk overwrote it) would then see (tests use NaN)."""
    for t in [*_kept().values(), *(t for ts in _returned().values() for t in ts)]:
        t.fill_(value)


def release() -> None:
    """Drop this thread's kept buffers and handed-back tensors (the next request maps afresh)."""
    _kept().clear()
    _returned().clear()


__all__ = ["BUFFERS_ENV", "KEEP_RETURNED", "borrow", "buffer", "fill_kept", "give_back", "kept_bytes", "kept_storages",
           "release", "reusing"]
