"""Unit behaviours of the Hybrid layers: masks, sinks, experts, dispatch, names, patterns."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.attention.backends import sink_attention
from gptoss_cli.model.attention.masks import attention_mask
from gptoss_cli.model.catalog import SLIDING_QUERY_BLOCK
from gptoss_cli.model.hybrid import HybridModel, layer_windows
from gptoss_cli.model.dispatcher import AllToAllTokenDispatcher
from gptoss_cli.model.gemm.grouped import grouped_linear
from gptoss_cli.model.mlp import clamped_swiglu
from gptoss_cli.model.moe import MoELayer
from gptoss_cli.model.pattern import parse_pattern, schedule_plan_support
from tests.model.conftest import TINY, tokens
from tests.tolerances import assert_tensors_close, reassociation_rel


def test_sliding_window_mask_sees_exactly_w_keys_including_itself():
    w, s = 3, 7
    mask = attention_mask(s, w, torch.device("cpu"))
    assert mask[:, 0].all()  # the sink column
    for q in range(s):
        visible = [k for k in range(s) if mask[q, k + 1]]
        assert visible == list(range(max(0, q - w + 1), q + 1))


def test_full_mask_is_causal():
    mask = attention_mask(5, None, torch.device("cpu"))[:, 1:]
    assert torch.equal(mask, torch.ones(5, 5, dtype=torch.bool).tril())


def _naive_sink_attention(q, k, v, sinks, window):
    # Section 2 literally: the sink joins the softmax as an extra column that is then dropped.
    b, nh, s, d = q.shape
    r = nh // k.shape[1]
    k = k.repeat_interleave(r, dim=1)
    v = v.repeat_interleave(r, dim=1)
    scores = q @ k.transpose(-1, -2) * d**-0.5
    qi = torch.arange(s)[:, None]
    ki = torch.arange(s)[None, :]
    ok = ki <= qi
    if window is not None:
        ok &= qi - window < ki
    scores = scores.masked_fill(~ok, float("-inf"))
    full = torch.cat([scores, sinks.view(1, nh, 1, 1).expand(b, nh, s, 1)], dim=-1)
    return torch.softmax(full, dim=-1)[..., :-1] @ v


def _sink_inputs(head_dim: int, seq: int = 11):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, seq, head_dim, generator=g, requires_grad=True)
    k = torch.randn(2, 2, seq, head_dim, generator=g, requires_grad=True)
    v = torch.randn(2, 2, seq, head_dim, generator=g, requires_grad=True)
    sinks = torch.randn(6, generator=g, requires_grad=True)
    return q, k, v, sinks


# The CPU flash kernel's unpadded path (model/attention/sink_flash.py) and the padded head dim (SDPA's sink key).
# FlexAttention's own checks: tests/model/test_attention_backends.py.
PATHS = pytest.mark.parametrize("backend", ["flash", "sdpa"])


@PATHS
@pytest.mark.parametrize("head_dim", [16, 64], ids=["tiny", "gpt-oss"])
@pytest.mark.parametrize("window", [None, 4])
def test_sink_attention_and_its_gradients_match_extra_column_softmax(window, head_dim, backend):
    q, k, v, sinks = _sink_inputs(head_dim)
    got = sink_attention(q, k, v, sinks, window, backend)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (q, k, v, sinks), grad)
    expected = _naive_sink_attention(q, k, v, sinks, window)
    exp_grads = torch.autograd.grad(expected, (q, k, v, sinks), grad)
    # Same math, other summation order (a fused kernel's blocked softmax against the naive one):
    # the longest sums run over the head dim or the 12 keys and 3 query heads per kv head, through
    # softmax forward and backward (tests/tolerances.py).
    rel = reassociation_rel(max(head_dim, 3 * 12), depth=3)
    names = ("out", "dq", "dk", "dv", "dsinks")
    assert_tensors_close(dict(zip(names, (got, *got_grads))), dict(zip(names, (expected, *exp_grads))), rel)


# Longer than two query blocks with a ragged last one; windows below and above the block size,
# and none (causal through SDPA's own causal rule, one zero query row in front).
LONG_SEQ = 2 * SLIDING_QUERY_BLOCK + 29


@PATHS
@pytest.mark.parametrize("window", [5, SLIDING_QUERY_BLOCK + 3, None])
def test_long_sequence_attention_matches_extra_column_softmax(window, backend):
    q, k, v, sinks = _sink_inputs(16, LONG_SEQ)
    got = sink_attention(q, k, v, sinks, window, backend)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (q, k, v, sinks), grad)
    expected = _naive_sink_attention(q, k, v, sinks, window)
    exp_grads = torch.autograd.grad(expected, (q, k, v, sinks), grad)
    # As above; the longest sums run over the window + 1 keys, or over the 3 query heads of a kv
    # head times the queries that see one key (its gradient), at most the window.
    rel = reassociation_rel(max(16, 3 * ((window or LONG_SEQ) + 1)), depth=3)
    names = ("out", "dq", "dk", "dv", "dsinks")
    assert_tensors_close(dict(zip(names, (got, *got_grads))), dict(zip(names, (expected, *exp_grads))), rel)


@PATHS
def test_sliding_attention_scores_only_the_keys_a_query_block_can_see(backend):
    # A sliding layer's cost must scale with the window, not with the sequence: every SDPA call
    # gets one block of queries and at most block + window keys (the sink included).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: list[tuple[int, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__.startswith("_scaled_dot_product") and "backward" not in str(func):
                self.calls.append((args[0].shape[2], args[1].shape[2]))
            return func(*args, **(kwargs or {}))

    window = 5
    q, k, v, sinks = _sink_inputs(64, LONG_SEQ)
    with Shapes() as seen:
        sink_attention(q, k, v, sinks, window, backend)
    assert sum(rows for rows, _ in seen.calls) == LONG_SEQ
    assert len(seen.calls) == 3 and all(keys <= rows + window for rows, keys in seen.calls), seen.calls


def test_padded_sink_attention_runs_a_fused_sdpa_kernel_not_the_math_path():
    # q, k and v must share one head dim for SDPA's fused kernels; with v left narrower than the
    # sink-augmented q/k, SDPA silently takes its math path (a [S, S+1] softmax in memory).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    q, k, v, sinks = _sink_inputs(64)
    with Ops() as ops:
        sink_attention(q, k, v, sinks, None, "sdpa").sum().backward()
    fused = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}
    assert fused <= ops.seen and "_safe_softmax" not in ops.seen, sorted(ops.seen)


def test_windows_follow_hf_block_index_not_physical_index():
    arch = TINY  # blocks 0 and 2 sliding, block 1 full
    windows = layer_windows(arch, parse_pattern("*E-*E*E"))
    assert windows == {0: 8, 3: None, 5: 8}


def test_clamped_swiglu_matches_reference_formula():
    gate = torch.tensor([-9.0, 0.5, 8.0, 3.0])
    up = torch.tensor([-9.0, 0.25, 8.0, -2.0])
    got = clamped_swiglu(torch.cat([gate, up]), 7.0, 1.702)
    g = gate.clamp(max=7.0)
    u = up.clamp(-7.0, 7.0)
    torch.testing.assert_close(got, (u + 1) * g * torch.sigmoid(1.702 * g))


def test_clamped_swiglu_gradient_equals_autograd_of_the_formula_at_and_beyond_the_clamps():
    # Gate and up at -limit, +limit (gradient passes, torch.clamp's convention), beyond them (none)
    # and inside; fp64, so the two differ only by reassociation of a few products.
    limit, alpha = 7.0, 1.702
    gate = torch.tensor([-9.0, -7.0, 0.5, 7.0, 8.0, 3.0, 7.0, -2.0], dtype=torch.float64)
    up = torch.tensor([-9.0, 7.0, 0.25, -7.0, 8.0, -2.0, 9.0, 7.0], dtype=torch.float64)
    gate_up = torch.cat([gate, up]).view(1, -1).repeat(3, 1).requires_grad_()
    grad = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (got,) = torch.autograd.grad(clamped_swiglu(gate_up, limit, alpha), gate_up, grad)
    g, u = gate_up.chunk(2, dim=-1)
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    (want,) = torch.autograd.grad((u + 1) * g * torch.sigmoid(alpha * g), gate_up, grad)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (got[:, [4, 8, 12, 14]] == 0).all()  # gate 8 > limit; up -9, 8, 9 outside the bounds


def test_grouped_gemm_equals_per_expert_linear_with_an_empty_expert():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 32, 16, generator=g)
    b = torch.randn(4, 32, generator=g)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 16, generator=g)
    got = grouped_linear(x, w, b, counts)
    starts = [0, 3, 3, 8, 10]
    expected = torch.cat([x[starts[e]:starts[e + 1]] @ w[e].T + b[e] for e in range(4)])
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("delayed", [False, True], ids=["wgrad-at-once", "delayed-wgrad"])
def test_grouped_linear_gradients_equal_autograd_of_per_expert_linear(delayed):
    # Empty experts first, inside and last, so a bias added to or summed from the wrong rows shows.
    from gptoss_cli.model.gemm.grouped import WgradQueue

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([0, 3, 0, 5, 2, 0])
    w = torch.randn(6, 32, 16, generator=g, requires_grad=True)
    b = torch.randn(6, 32, generator=g, requires_grad=True)
    x = torch.randn(10, 16, generator=g, requires_grad=True)
    dy = torch.randn(10, 32, generator=g)
    queue = WgradQueue() if delayed else None
    got_y = grouped_linear(x, w, b, counts, wgrad_queue=queue)
    got_dx, *got_params = torch.autograd.grad(got_y, (x,) if delayed else (x, w, b), dy)
    if delayed:
        w.grad = b.grad = None
        assert queue.execute() == 1
        got_params = [w.grad, b.grad]
    starts = [0, 0, 3, 3, 8, 10, 10]
    want_y = torch.cat([torch.nn.functional.linear(x[starts[e]:starts[e + 1]], w[e], b[e]) for e in range(6)])
    want = torch.autograd.grad(want_y, (x, w, b), dy)
    torch.testing.assert_close(got_y, want_y)
    for name, got_t, want_t in zip(("dx", "dw", "db"), (got_dx, *got_params), want):
        torch.testing.assert_close(got_t, want_t, msg=lambda m, n=name: f"{n}: {m}")
    assert (got_params[1][[0, 2, 5]] == 0).all()


def test_local_dispatcher_combine_applies_weights_and_sums_top_k():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 8, generator=g)
    indices = torch.tensor([[2, 0], [1, 2], [3, 1], [0, 3], [2, 1]])
    probs = torch.softmax(torch.randn(5, 2, generator=g), -1)
    d = AllToAllTokenDispatcher(4)
    x, counts, ctx = d.dispatch(hidden, probs, indices)
    assert counts.tolist() == [2, 3, 3, 2]
    # Each row must be the token of its (token, choice) pair, grouped by expert.
    scale = torch.arange(1, 5, dtype=torch.float32).repeat_interleave(counts)[:, None]
    out = d.combine(x * scale, ctx)  # "expert e multiplies by e+1"
    expected = sum(probs[:, j:j + 1] * hidden * (indices[:, j:j + 1] + 1) for j in range(2))
    torch.testing.assert_close(out, expected)


def test_expert_slice_saves_and_loads_its_experts_under_global_ids():
    full = MoELayer(TINY)
    torch.nn.init.normal_(full.mlp.experts.linear_fc1.weight)
    part = MoELayer(TINY, expert_offset=2, num_local_experts=2, token_dispatcher=AllToAllTokenDispatcher(4))
    sd = full.state_dict()
    mine = {k: v for k, v in sd.items() if not k.endswith(("weight0", "weight1", "bias0", "bias1"))}
    part.load_state_dict(mine, strict=True)
    assert torch.equal(part.mlp.experts.linear_fc1.weight, full.mlp.experts.linear_fc1.weight[2:])
    keys = [k for k in part.state_dict() if "linear_fc2" in k]
    assert keys == ["mlp.experts.linear_fc2.weight2", "mlp.experts.linear_fc2.weight3",
                    "mlp.experts.linear_fc2.bias2", "mlp.experts.linear_fc2.bias3"]


def test_missing_expert_tensor_is_reported_by_its_name():
    layer = MoELayer(TINY)
    sd = layer.state_dict()
    del sd["mlp.experts.linear_fc2.weight3"]
    result = layer.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["mlp.experts.linear_fc2.weight3"]


def test_expert_range_outside_the_architecture_is_rejected():
    with pytest.raises(ConfigError, match=r"\[3, 5\)"):
        MoELayer(TINY, expert_offset=3, num_local_experts=2)


def test_expert_slice_without_dispatcher_names_the_fix():
    layer = MoELayer(TINY, expert_offset=0, num_local_experts=2)
    with pytest.raises(ConfigError, match="token_dispatcher"):
        layer(torch.randn(1, 3, TINY.hidden_size))


def test_state_dict_keys_are_the_hybrid_checkpoint_names():
    names = set(HybridModel(TINY, device="meta").state_dict())
    expected = {"embedding.word_embeddings.weight", "decoder.final_norm.weight", "output_layer.weight"}
    for i in range(3):
        a, m = f"decoder.layers.{2 * i}.self_attention.", f"decoder.layers.{2 * i + 1}."
        expected |= {a + "linear_qkv.layer_norm_weight", a + "linear_qkv.weight", a + "linear_qkv.bias",
                     a + "linear_proj.weight", a + "linear_proj.bias", a + "core_attention.softmax_offset",
                     m + "pre_mlp_layernorm.weight", m + "mlp.router.weight", m + "mlp.router.bias"}
        for e in range(4):
            for fc in ("linear_fc1", "linear_fc2"):
                expected |= {m + f"mlp.experts.{fc}.weight{e}", m + f"mlp.experts.{fc}.bias{e}"}
    assert names == expected


def test_expert_tensor_shapes_are_out_by_in():
    sd = HybridModel(TINY, device="meta").state_dict()
    assert tuple(sd["decoder.layers.1.mlp.experts.linear_fc1.weight0"].shape) == (192, 64)
    assert tuple(sd["decoder.layers.1.mlp.experts.linear_fc2.weight0"].shape) == (64, 96)
    assert tuple(sd["decoder.layers.0.self_attention.linear_qkv.weight"].shape) == (160, 64)


def test_dense_mlp_layer_has_megatron_names_and_runs():
    model = HybridModel(TINY, parse_pattern("*-*E*E"))
    names = [k for k in model.state_dict() if k.startswith("decoder.layers.1.")]
    assert names == ["decoder.layers.1.pre_mlp_layernorm.weight", "decoder.layers.1.mlp.linear_fc1.weight",
                     "decoder.layers.1.mlp.linear_fc1.bias", "decoder.layers.1.mlp.linear_fc2.weight",
                     "decoder.layers.1.mlp.linear_fc2.bias"]
    assert model(tokens(1, 5)).logits.shape == (1, 5, TINY.vocab_size)


def test_grouped_pattern_builds_the_same_layers():
    model = HybridModel(TINY, parse_pattern("[*E][*E]|[*E]"))
    assert [type(m).__name__ for m in model.decoder.layers] == ["AttentionLayer", "MoELayer"] * 3


def test_mamba_symbol_is_rejected_by_name():
    with pytest.raises(ConfigError, match=r"'M' \(mamba\)"):
        HybridModel(TINY, parse_pattern("*E*M*E"))


def test_pattern_with_wrong_attention_count_is_rejected():
    with pytest.raises(ConfigError, match="num_hidden_layers=3"):
        HybridModel(TINY, parse_pattern("*E*E"))


def test_schedule_plan_is_supported_for_attention_moe_and_mlp_patterns():
    # Issue 6 gave HybridModel a build_schedule_plan; plan tests live in tests/schedule/.
    assert schedule_plan_support(parse_pattern("*E*E")) == (True, "")
    assert schedule_plan_support(parse_pattern("[*E][*E]")) == (True, "")
    ok, why = schedule_plan_support(parse_pattern("*E*M"))
    assert not ok and "'M'" in why


def test_loop_over_experts_fallback_equals_grouped_gemm(monkeypatch):
    import gptoss_cli.model.gemm.grouped as grouped_gemm

    model = HybridModel(TINY).eval()
    ids = tokens(2, 9)
    with torch.no_grad():
        grouped = model(ids).logits
        monkeypatch.setattr(grouped_gemm, "_grouped_mm_usable", lambda a, shape: False)
        looped = model(ids).logits
    torch.testing.assert_close(looped, grouped, rtol=1e-5, atol=1e-5)


def test_gradients_reach_every_parameter():
    model = HybridModel(TINY).train()
    ids = tokens(2, 12)
    labels = torch.roll(ids, -1, dims=1)
    model(ids, labels=labels).loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert no_grad == []
