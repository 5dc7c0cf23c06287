"""Every attention backend (model/attention/backends.py: flash, flex, sdpa): forward and every gradient
against transformers' eager GPT-OSS attention, on the CPU.

Reference: transformers' `eager_attention_forward` of GPT-OSS (the sink as an explicit softmax
column, k/v heads repeated for GQA) with the mask transformers' own mask functions give
(`causal_mask_function`, `sliding_window_causal_mask_function`), differentiated by autograd in
float64. Cases: windows below and above a query block, none; GQA (6 query heads on 2 kv heads);
packed documents; head dims 16 and 64; fp64, fp32 and bf16 inputs.

Error model (tests/tolerances.py): both compute the same sums in another order (a blocked online
softmax and its flash backward, FlexAttention's reference, or SDPA with the sink key, against explicit
scores and softmax); the longest sums run over the head dim, the keys a query sees (+ the sink) or,
for dk/dv/dsinks, the query heads of a kv head times the queries that see one key; through softmax
forward and backward, depth 3. In float64 the same bound with u = 2**-53 pins the derivation itself:
a wrong log-sum-exp, window or sink term is off by O(1), not O(1e-13).

On the CPU, `flex` runs FlexAttention's reference implementation (the higher-order op with its own
backward; torch refuses the public function's backward on a CPU, compiled or not): the mask function,
block mask, log-sum-exp and sink formula the compiled CUDA kernel gets, in dense math.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.attention import sink_flash
from gptoss_cli.model.attention.backends import document_attention, sink_attention
from gptoss_cli.model.catalog import SLIDING_QUERY_BLOCK
from gptoss_cli.model.positions import document_offsets
from tests.tolerances import assert_tensors_close, reassociation_rel

modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
masking = pytest.importorskip("transformers.masking_utils")

U_FP64 = 2.0**-53
NAMES = ("out", "dq", "dk", "dv", "dsinks")
LONG_SEQ = 2 * SLIDING_QUERY_BLOCK + 29  # three query blocks, the last ragged


def _inputs(seq: int, head_dim: int, dtype=torch.float32, heads: int = 6, kv: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype).requires_grad_()  # noqa: E731
    return make(2, heads, seq, head_dim), make(2, kv, seq, head_dim), make(2, kv, seq, head_dim), make(heads)


def _hf_attention(q, k, v, sinks, window):
    """transformers' eager GPT-OSS attention in float64: [B, h, S, d] -> [B, h, S, d]."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    s = q.shape[2]
    qi, ki = torch.arange(s)[:, None], torch.arange(s)[None, :]
    rule = masking.causal_mask_function if window is None else masking.sliding_window_causal_mask_function(window)
    visible = torch.as_tensor(rule(0, 0, qi, ki)).expand(s, s)
    mask = torch.zeros(s, s, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks, training=False)
    out, _ = modeling.eager_attention_forward(module, q, k, v, mask[None, None], q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


def _with_grads(fn, inputs, grad):
    out = fn(*inputs)
    return dict(zip(NAMES, (out, *torch.autograd.grad(out, inputs, grad.to(out.dtype)))))


def _bound(head_dim: int, keys: int, u: float) -> float:
    return reassociation_rel(max(head_dim, 3 * (keys + 1)), depth=3, u=u)


CASES = [  # (seq, head_dim, window): odd lengths, one and several query blocks, windows below/above a block
    (11, 16, None), (11, 64, None), (11, 16, 4), (LONG_SEQ, 16, None), (LONG_SEQ, 16, 5),
    (LONG_SEQ, 64, SLIDING_QUERY_BLOCK + 3),
]


BACKENDS = pytest.mark.parametrize("backend", ["flash", "flex", "sdpa"])


@BACKENDS
@pytest.mark.parametrize("seq,head_dim,window", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_sink_attention_and_gradients_match_transformers_eager(seq, head_dim, window, dtype, backend):
    inputs = _inputs(seq, head_dim, dtype)
    grad = torch.randn(2, 6, seq, head_dim, generator=torch.Generator().manual_seed(1))
    got = _with_grads(lambda *t: sink_attention(*t, window, backend), inputs, grad)
    want = _with_grads(lambda *t: _hf_attention(*t, window), inputs, grad)
    u = U_FP64 if dtype == torch.float64 else 2.0**-24
    assert_tensors_close(got, want, _bound(head_dim, window or seq, u), (seq, head_dim, window, dtype))


@BACKENDS
def test_bf16_every_backend_is_as_close_to_transformers_as_its_rounding_allows(backend):
    # bf16: the kernel accumulates in fp32 but rounds its output, the rescaled output backward reads
    # and every gradient to bf16 (u = 2**-8); per tensor a few such roundings through forward and
    # backward (depth 3) and two for the inputs of the sink term: reassociation_rel(2, 3, 2**-8)
    # of each tensor's largest magnitude. Both paths must meet it against the float64 reference.
    inputs = _inputs(LONG_SEQ, 64, torch.bfloat16)
    grad = torch.randn(2, 6, LONG_SEQ, 64, generator=torch.Generator().manual_seed(1))
    for window in (None, 8):
        want = _with_grads(lambda *t: _hf_attention(*t, window), inputs, grad)
        got = _with_grads(lambda *t: sink_attention(*t, window, backend), inputs, grad)
        assert got["out"].dtype == torch.bfloat16
        assert_tensors_close(got, want, reassociation_rel(2, depth=3, u=2.0**-8), (window, backend))


@BACKENDS
def test_packed_documents_match_transformers_on_each_document_alone(backend):
    # Documents shorter and longer than the window, one spanning several query blocks, in two rows.
    seq, window = SLIDING_QUERY_BLOCK + 40, 6
    cu = document_offsets([[3, SLIDING_QUERY_BLOCK + 20, 17], [1, 50]], seq)
    inputs = _inputs(seq, 16, torch.float64)
    grad = torch.randn(2, 6, seq, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def per_document(q, k, v, sinks):
        flat = [t.transpose(0, 1).reshape(t.shape[1], -1, t.shape[-1]) for t in (q, k, v)]
        outs = [_hf_attention(*(t[None, :, a:b] for t in flat), sinks, window)[0] for a, b in zip(cu[:-1], cu[1:])]
        return torch.cat(outs, dim=1).view(6, 2, seq, 16).transpose(0, 1)

    got = _with_grads(lambda *t: document_attention(*t, window, cu, backend), inputs, grad)
    want = _with_grads(per_document, inputs, grad)
    assert_tensors_close(got, want, _bound(16, window, U_FP64))


def test_cpu_attention_runs_the_flash_kernel_at_the_real_head_dim():
    # The seam: on the CPU `sink_attention` takes the unpadded path (head dim 64 into the kernel,
    # not 72, forward and backward); where the CPU flash kernel is not (here: meta tensors, as
    # bench/scale.py uses) it falls back to the padded path.
    from torch.utils._python_dispatch import TorchDispatchMode

    class HeadDims(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dims: set[tuple[str, int]] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name.startswith("_scaled_dot_product"):
                self.dims.add((name, args[1].shape[-1]))
            return func(*args, **(kwargs or {}))

    q, k, v, sinks = _inputs(LONG_SEQ, 64)
    for window in (None, 8):
        with HeadDims() as seen:
            sink_attention(q, k, v, sinks, window).sum().backward()
        assert seen.dims == {("_scaled_dot_product_flash_attention_for_cpu", 64),
                             ("_scaled_dot_product_flash_attention_for_cpu_backward", 64)}, seen.dims
    meta = [t.detach().to("meta") for t in (q, k, v, sinks)]
    assert not sink_flash.available(meta[0])
    assert sink_attention(*meta, 8).shape == q.shape
    with pytest.raises(ConfigError, match="no flash kernel computes"):
        sink_attention(*meta, 8, "flash")


# --- the backend as the model and the recipe choose it ----------------------------------------------
def test_the_model_computes_the_same_loss_and_gradients_with_every_backend():
    # The tiny model (a sliding layer with window 8 and full layers), packed documents, float64: every
    # gradient of the model agrees with the flash kernel's to float64 rounding; a backend that drops
    # a document boundary or the window would move them by whole units.
    from gptoss_cli.model.config import preset
    from gptoss_cli.model.hybrid import HybridModel
    from gptoss_cli.model.positions import document_offsets

    torch.manual_seed(0)
    model = HybridModel(preset("tiny"), dtype=torch.float64)
    ids = torch.randint(0, 1003, (2, 24), generator=torch.Generator().manual_seed(3))
    cu = document_offsets([[5, 19], [24]], 24)
    results = {}
    for backend in ("flash", "flex", "sdpa"):
        model.set_attention_backend(backend)
        model.zero_grad()
        loss = model(ids, labels=ids.roll(-1, 1), cu_seqlens=cu).loss
        loss.backward()
        results[backend] = {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}
    for backend in ("flex", "sdpa"):
        assert_tensors_close(results[backend], results["flash"], reassociation_rel(1003, depth=8, u=U_FP64), backend)


def test_an_unknown_backend_is_one_line_exit_2():
    from typer.testing import CliRunner

    from gptoss_cli.cli.app import app

    result = CliRunner().invoke(app, ["validate-config", "tiny_cpu_ep2", "model.attention_backend=fast"])
    assert result.exit_code == 2 and "model.attention_backend" in result.output and "Traceback" not in result.output
    with pytest.raises(ConfigError, match="attention_backend 'fast' is not one of auto, flash, flex, sdpa"):
        sink_attention(*_inputs(4, 8), None, "fast")
