"""Two terms of the memory estimate that live outside the layers, tied to what the code allocates.

Measured on the CPU with tests/recipe/live_bytes.py (every storage an op creates, until its last
tensor dies): the output layer's gradient that the chunked loss computes in the forward pass (an fp32
accumulator, then its params-dtype copy held until backward), and the transient of a LoRA layer whose
frozen experts are MXFP4 (one layer's stack decoded to the params dtype; under MXFP4 QAT a second,
rounded copy of it).
"""

from __future__ import annotations

import gc

import pytest
import torch

from gptoss_cli.model.config import preset
from gptoss_cli.model.workspace import BUFFERS_ENV
from gptoss_cli.model.pattern import parse_pattern
from gptoss_cli.recipe import load_recipe
from gptoss_cli.recipe.estimate import memory as M
from tests.recipe.live_bytes import LiveBytes

SMALL = ["parallelism.world_size=1", "parallelism.expert_model_parallel_size=1", "training.micro_batch_size=1",
         "training.global_batch_size=1"]


def _chunked_loss_bytes(vocab: int, hidden: int, tokens: int, trainable: bool) -> tuple[int, int]:
    """(peak, held after the forward) of the bf16 chunked LM loss over `tokens` tokens, one chunk."""
    from gptoss_cli.model.loss import chunked_lm_loss_sum

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16).requires_grad_(trainable)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    with LiveBytes() as live:
        loss = chunked_lm_loss_sum(x, weight, labels)
        gc.collect()
        held, peak = live.current, live.peak
        loss.backward()
    return peak, held


def test_the_output_layers_gradient_term_is_what_the_chunked_loss_allocates(monkeypatch):
    """The estimate's output-layer term (its logits item with a trainable head minus a frozen one, LoRA)
    against the chunked loss measured with a trainable and a frozen weight: the bf16 gradient held
    until backward is exactly b*V*h, and the forward's extra peak (fp32 accumulator + that copy, (4 + b)
    V*h) is the estimate's term up to the chunk's own tensors (the frozen run's whole peak), which may
    or may not coexist with the conversion. h = 512 >> tokens so that V*h dominates. The estimate is a
    GPU's, where the chunk's buffers are fresh tensors (model/workspace.py): measured so here too."""
    monkeypatch.setenv(BUFFERS_ENV, "fresh")
    tokens = 8
    arch = preset("tiny").replace(hidden_size=512)
    seq = [f"training.seq_length={tokens}"]
    full = M.estimate_memory(load_recipe("tiny_cpu_ep2", [*SMALL, *seq]).config, arch, parse_pattern("*E*E*E"), 1)
    lora = M.estimate_memory(load_recipe("tiny_cpu_ep2", [*SMALL, *seq, "lora.rank=4",
                                                          "lora.target_modules=[linear_qkv]"]).config,
                             arch, parse_pattern("*E*E*E"), 1)
    term = full.bytes_of("activations.logits") - lora.bytes_of("activations.logits")
    vh = arch.vocab_size * arch.hidden_size
    peak, held = _chunked_loss_bytes(arch.vocab_size, arch.hidden_size, tokens, trainable=True)
    frozen_peak, frozen_held = _chunked_loss_bytes(arch.vocab_size, arch.hidden_size, tokens, trainable=False)
    assert held - frozen_held == 2 * vh  # the bf16 gradient held until backward
    assert term - frozen_peak <= peak - frozen_peak <= term, (peak - frozen_peak, term, frozen_peak)


def _mxfp4_layer_transient(num_experts: int, out: int, inp: int, qat: bool) -> tuple[int, int]:
    """(bytes the forward of an adapted MXFP4 expert layer allocates beyond its output, weight elements)."""
    from gptoss_cli.model.lora import ExpertLoraAdapter, LoraSettings
    from gptoss_cli.model.mxfp4.codec import encode
    from gptoss_cli.model.mxfp4.experts import Mxfp4ExpertLinear
    from gptoss_cli.model.mxfp4.qat import Mxfp4QatGemm

    layer = Mxfp4ExpertLinear(num_experts, 0, out, inp, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    blocks, scales = encode(torch.randn(num_experts, out, inp, generator=g).to(torch.bfloat16))
    layer.blocks.copy_(blocks)
    layer.scales.copy_(scales)
    if qat:
        layer.gemm = Mxfp4QatGemm()
    adapter = ExpertLoraAdapter(layer, LoraSettings(rank=4, alpha=8.0, target_modules=("linear_fc1",)),
                                dtype=torch.bfloat16)
    x = torch.randn(num_experts, inp, generator=g).to(torch.bfloat16).requires_grad_(True)
    counts = torch.ones(num_experts, dtype=torch.int64)
    adapter.adapted(layer, x, counts)  # the decoder's cached lookup table and index buffer, once
    with LiveBytes() as live:
        y = adapter.adapted(layer, x, counts)
        peak = live.peak
    return peak - y.untyped_storage().nbytes(), num_experts * out * inp


@pytest.mark.parametrize("qat", [False, True], ids=["plain", "qat"])
def test_an_mxfp4_bases_decode_transient_is_what_a_layer_allocates(qat):
    """lora.base_experts=mxfp4 at 32 local experts (the 20B at EP=1): the estimate's transient.decode
    (one layer's fc1 stack in bf16; two under MXFP4 QAT: decoded, then rounded with the adapters merged)
    against the forward of such a layer. Measured on top: the decoder's int32 scale index (2 x 4 bytes
    per 32 weights) and, under QAT, one expert's merge at a time (float64 W + B@A and its fp32 rounding,
    at most 40 bytes per weight of one expert)."""
    arch = preset("tiny").replace(num_local_experts=32)
    overrides = [*SMALL, "lora.rank=4", "lora.target_modules=[linear_fc1]", "lora.base_experts=mxfp4"]
    if qat:
        overrides.append("precision.qat=mxfp4")
    est = M.estimate_memory(load_recipe("tiny_cpu_ep2", overrides).config, arch, parse_pattern("*E*E*E"), 1)
    want = est.bytes_of("transient.decode")
    got, n = _mxfp4_layer_transient(32, 2 * arch.intermediate_size, arch.hidden_size, qat)
    assert want == (2 if qat else 1) * 2 * n  # the fc1 stack is the largest expert weight
    slack = n * 8 // 32 + (40 * n // 32 if qat else 0)
    assert want <= got <= want + slack, (got / n, want / n, slack / n)
