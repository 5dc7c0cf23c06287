"""Packed documents: per-document attention and positions (model/attention/backends.py, `document_attention`).

References: transformers' GptOssForCausalLM run on each document alone (logits), and our own model
run on each document alone (loss and every gradient). Error model (tests/tolerances.py): the
packed and the separate runs compute every per-token quantity from the same inputs; what changes
is the order of the sums over tokens (the loss and the weight gradients add up over the packed row
instead of over each document, the routed tokens of an expert are grouped differently) and the
SDPA blocking of each document's keys, so they agree within the reassociation bound of the longest
such sum (the row's tokens, or a hidden/intermediate dot product), compounded over every layer of
the forward and backward pass.
"""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.model.attention.backends import document_attention, sink_attention
from gptoss_cli.model.positions import document_offsets, document_positions
from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.loss import IGNORE_INDEX
from tests.model.conftest import TINY, hf_to_hybrid_state_dict
from tests.tolerances import assert_tensors_close, reassociation_rel

S = 40
# Two rows of packed documents (lengths), the rest of each row padding. 21 and 30 are longer than
# twice the sliding window (8), so windows and sinks inside a document matter; 2 is the shortest.
ROWS = [[21, 7, 9], [2, 30]]


def _documents(seed: int = 3) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, TINY.vocab_size, (n,), generator=g) for n in row] for row in ROWS]


def _pack(docs: list[list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(input ids [2, S], labels [2, S], cu_seqlens): each document's labels are its next tokens, its
    last token and the padding get IGNORE_INDEX."""
    ids = torch.full((len(docs), S), 5, dtype=torch.long)  # padding: a real token id, no label
    labels = torch.full((len(docs), S), IGNORE_INDEX, dtype=torch.long)
    for r, row in enumerate(docs):
        at = 0
        for d in row:
            ids[r, at:at + len(d)] = d
            labels[r, at:at + len(d) - 1] = d[1:]
            at += len(d)
    return ids, labels, document_offsets([[len(d) for d in row] for row in docs], S)


def test_offsets_and_positions():
    cu = document_offsets(ROWS, S)
    assert cu == (0, 21, 28, 37, 40, 42, 72, 80)
    pos = document_positions(cu, 2, S)
    assert pos[0, :21].tolist() == list(range(21)) and pos[0, 21:28].tolist() == list(range(7))
    assert pos[1, 2:32].tolist() == list(range(30)) and pos[1, 32:].tolist() == list(range(8))
    with pytest.raises(ValueError, match="row 0"):
        document_offsets([[30, 11]], S)


def test_document_attention_crossing_a_row_is_refused():
    q = torch.randn(2, 6, S, 16)
    k = v = torch.randn(2, 2, S, 16)
    with pytest.raises(ValueError, match="crosses a row boundary"):
        document_attention(q, k, v, torch.zeros(6), None, (0, 30, 50, 80))


def test_one_document_per_row_is_plain_sink_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 6, S, 16, generator=g), torch.randn(2, 2, S, 16, generator=g), torch.randn(2, 2, S, 16, generator=g)
    sinks = torch.randn(6, generator=g)
    for window in (None, 8):
        torch.testing.assert_close(document_attention(q, k, v, sinks, window, (0, S, 2 * S)),
                                   sink_attention(q, k, v, sinks, window), rtol=0, atol=0)


def test_packed_logits_equal_transformers_on_each_document_alone(hf_tiny):
    """No token attends across a document boundary; positions restart; windows and sinks apply
    within the document: every document's logits in the packed rows are transformers' logits of that
    document run alone (same tolerance as tests/model/test_hybrid_vs_transformers.py)."""
    docs = _documents()
    ids, _, cu = _pack(docs)
    model = HybridModel(TINY).eval()
    model.load_state_dict(hf_to_hybrid_state_dict(hf_tiny.state_dict()), strict=True)
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu).logits
        for r, row in enumerate(docs):
            at = 0
            for d in row:
                alone = hf_tiny(d[None]).logits[0]
                torch.testing.assert_close(packed[r, at:at + len(d)], alone, rtol=1e-5, atol=1e-5)
                at += len(d)


def test_packed_loss_and_gradients_equal_each_document_alone():
    """A packed row's summed loss and every parameter gradient equal the sums over its documents run
    alone (fp32). aux loss off: the load-balancing loss is, by definition, a statistic of the batch."""
    torch.manual_seed(0)
    model = HybridModel(TINY).train()
    model.aux_loss_coef = 0.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("softmax_offset"):
                p.normal_()  # sinks that matter
    docs = _documents()
    ids, labels, cu = _pack(docs)

    packed_loss = model(ids, cu_seqlens=cu).lm_loss_sum(labels)
    packed_loss.backward()
    packed = {"loss": packed_loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}
    model.zero_grad()
    alone_loss = torch.zeros(())
    for row in docs:
        for d in row:
            lab = torch.cat([d[1:], torch.tensor([IGNORE_INDEX])])[None]
            loss = model(d[None]).lm_loss_sum(lab)
            loss.backward()
            alone_loss += loss.detach()
    alone = {"loss": alone_loss, **{n: p.grad.clone() for n, p in model.named_parameters()}}
    layers = len(model.decoder.layers) + 2
    rel = reassociation_rel(max(2 * S, TINY.hidden_size, TINY.intermediate_size), depth=2 * layers)
    assert_tensors_close(packed, alone, rel)


def test_schedule_plan_runs_packed_documents_like_forward():
    """The overlap schedule's plan takes the same document boundaries as forward."""
    torch.manual_seed(0)
    model = HybridModel(TINY).train()
    model.aux_loss_coef = 0.0
    ids, labels, cu = _pack(_documents())
    with torch.no_grad():
        want = model(ids, labels=labels, cu_seqlens=cu).loss
        plan = model.build_schedule_plan(ids, labels=labels, cu_seqlens=cu)
        got = plan.forward()["loss"]
        unpacked = model(ids, labels=labels).loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert abs(float(unpacked - want)) > 1e-4  # the boundaries change this loss, so the check has teeth
