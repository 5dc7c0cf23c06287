"""bf16 weight gradients summed in fp32 by the GEMM on the way into an fp32 main_grad (model/gemm/main_grad.py), and the LM-head chunk per device.

On CUDA (torch 2.10+) `torch.addmm(..., out_dtype=torch.float32)` sums bf16 products into an fp32
accumulator in one kernel; `main_grad_target` then lets a bf16 parameter's backward add into its fp32
main_grad, and the chunked LM head accumulates its [V, h] gradient over the chunks in fp32 by the
GEMM. That CUDA-only switch (`fp32_accumulating_gemm`) is turned on here so the same logic runs on
the CPU, where `addmm_fp32_` / `mm_fp32` upcast the operands first (the same sums: a product of two
bf16 values is exact in fp32). References are fp64 sums of the same bf16 operands.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gptoss_cli.model import lm_head
from gptoss_cli.model.gemm import main_grad
from gptoss_cli.model.loss import chunked_lm_loss_sum, token_cross_entropy
from gptoss_cli.model.loss_chunk import LM_LOSS_CHUNK_TOKENS, lm_loss_chunk_tokens
from gptoss_cli.model.gemm.main_grad import embedding, take_added

SCALE = 0.375


@pytest.fixture
def fp32_gemm(monkeypatch):
    for module in (main_grad, lm_head):
        monkeypatch.setattr(module, "fp32_accumulating_gemm", lambda device: True)


def test_bf16_output_layer_gradient_is_summed_in_fp32_and_rounded_once(fp32_gemm):
    g = torch.Generator().manual_seed(0)
    v, h, tokens, chunk = 1003, 64, 96, 8  # 12 chunks
    hidden = torch.randn(tokens, h, generator=g).bfloat16().requires_grad_(True)
    w = nn.Parameter((torch.randn(v, h, generator=g) / h**0.5).bfloat16())
    labels = torch.randint(0, v, (tokens,), generator=g)
    before = torch.randn(v, h, generator=g)
    w.main_grad = before.clone()
    (SCALE * chunked_lm_loss_sum(hidden, w, labels, chunk_tokens=chunk)).backward()
    assert take_added(w, w.grad)  # the gradient went into main_grad, autograd got the stand-in

    # the same bf16 logit gradients the kernel multiplies, their products summed exactly
    exact = torch.zeros(v, h, dtype=torch.float64)
    for s in range(0, tokens, chunk):
        logits = F.linear(hidden.detach()[s:s + chunk], w.detach()).requires_grad_(True)
        (dlogits,) = torch.autograd.grad(token_cross_entropy(logits, labels[s:s + chunk], reduction="sum"), logits)
        exact += dlogits.double().t() @ hidden.detach()[s:s + chunk].double()
    # fp32 sum of `tokens` products (tokens 2^-24 of the sum of magnitudes), rounded once to bf16
    # (2^-8), scaled and added in fp32 (2^-24 each)
    magnitude = torch.zeros_like(exact)
    for s in range(0, tokens, chunk):
        logits = F.linear(hidden.detach()[s:s + chunk], w.detach()).requires_grad_(True)
        (dlogits,) = torch.autograd.grad(token_cross_entropy(logits, labels[s:s + chunk], reduction="sum"), logits)
        magnitude += dlogits.double().abs().t() @ hidden.detach()[s:s + chunk].double().abs()
    bound = SCALE * (2.0**-8 * exact.abs() + tokens * 2.0**-24 * magnitude) + 2.0**-23 * before.double().abs()
    got = w.main_grad.double() - before.double()
    assert torch.all((got - SCALE * exact).abs() <= bound + 1e-30)


def test_bf16_embedding_gradient_goes_into_main_grad_in_fp32(fp32_gemm):
    g = torch.Generator().manual_seed(1)
    w = nn.Parameter(torch.randn(50, 16, generator=g).bfloat16())
    ids = torch.randint(0, 5, (4, 32), generator=g)  # many repeats of five rows
    before = torch.randn(50, 16, generator=g)
    w.main_grad = before.clone()
    dy = torch.randn(4, 32, 16, generator=g).bfloat16()
    embedding(ids, w).backward(dy)
    assert take_added(w, w.grad)
    exact = before.double().index_add_(0, ids.reshape(-1), dy.reshape(-1, 16).double())
    sums = torch.zeros(50, 16, dtype=torch.float64).index_add_(0, ids.reshape(-1), dy.reshape(-1, 16).double().abs())
    assert torch.all((w.main_grad.double() - exact).abs() <= 129 * 2.0**-24 * (sums + before.double().abs()))


def test_without_fp32_accumulating_gemms_a_bf16_parameter_keeps_the_unfused_path():
    w = nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16))
    w.main_grad = torch.zeros(3, 4)
    assert main_grad.main_grad_target(w) is None  # the CPU: bf16 gradients reach the buffers' hook
    w32 = nn.Parameter(torch.zeros(3, 4))
    w32.main_grad = torch.zeros(3, 4)
    assert main_grad.main_grad_target(w32) is w32.main_grad


def test_lm_head_chunk_per_device():
    # the CPU: at most 256 tokens, fewer where the kept buffers (two fp32 rows per token, a third in a
    # non-fp32 activation dtype) would pass 1/32 of the host's memory, never fewer than 32
    gib = 2**30
    assert lm_loss_chunk_tokens(201_088, 2, "cpu", host_memory=64 * gib) == LM_LOSS_CHUNK_TOKENS == 256
    assert lm_loss_chunk_tokens(201_088, 4, "cpu", host_memory=8 * gib) == 160  # 8 x 201,088 B x 160 = 257 MB
    assert lm_loss_chunk_tokens(201_088, 2, "cpu", host_memory=8 * gib) == 128  # 10 x 201,088 B x 128 = 257 MB
    assert lm_loss_chunk_tokens(201_088, 4, "cpu", host_memory=1 * gib) == 32
    assert lm_loss_chunk_tokens(1003, 4, "cpu", host_memory=1 * gib) == 256
    # a GPU: the largest multiple of 256 whose (b + 12) V bytes per token fit 4 GiB, within [256, 4096]
    assert lm_loss_chunk_tokens(201_088, 2, "cuda") == 1280  # 14 x 201,088 B x 1280 = 3.6 GB
    assert lm_loss_chunk_tokens(1003, 2, "cuda") == 4096
    assert lm_loss_chunk_tokens(10**8, 2, "cuda") == 256


def test_a_bf16_gradient_added_in_blocks_equals_one_add():
    # add_cast_ adds a gradient of another dtype block by block (its cast's temporary stays small):
    # elementwise, so every element is the one add torch computes, bit for bit, the last block short
    g = torch.Generator().manual_seed(2)
    rows = 3 * main_grad.ADD_CAST_BLOCK // 64 + 1  # [rows, 64]: three blocks and a short fourth
    target, grad = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g).bfloat16()
    want = target + grad.float()
    assert main_grad.add_cast_(target, grad) is target
    assert torch.equal(target, want)
