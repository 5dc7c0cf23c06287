"""The KV-cache decoding path: greedy tokens equal transformers' `generate` (its own sliding-window
cache) token for token past the window, and each cached step equals recomputing the whole sequence."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.generate.decode import MAX_NEW_TOKENS, generate_ids
from gptoss_cli.model.decode import kv_cache
from gptoss_cli.model.hybrid import HybridModel
from gptoss_cli.model.decode.kv_cache import KVCache, forward_cached, next_token_logits, prefill
from tests.model.conftest import TINY, hf_to_hybrid_state_dict, tokens, transformers
from tests.tolerances import reassociation_rel

WINDOW = TINY.sliding_window
NEW = 3 * WINDOW + 1  # the decode runs well past the sliding window
# The cached path sums the same fp32 terms in another order (einsum scores, a softmax over cache
# columns): the widest contraction is the MoE intermediate size, compounded over every layer.
REL = reassociation_rel(TINY.intermediate_size, depth=2 * TINY.num_hidden_layers + 1)


def _ours(hf_model) -> HybridModel:
    model = HybridModel(TINY).eval()
    model.load_state_dict(hf_to_hybrid_state_dict(hf_model.state_dict()), strict=True)
    return model


def _hf_generate(hf_model, ids, attention_mask=None, new=NEW):
    cfg = transformers.GenerationConfig(max_new_tokens=new, min_new_tokens=0, do_sample=False,
                                        eos_token_id=None, pad_token_id=TINY.vocab_size - 2)
    out = hf_model.generate(ids, attention_mask=attention_mask, generation_config=cfg,
                            output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)


def _assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want.double()).abs().max().item()
    assert err <= REL * want.abs().max().item(), f"max |diff| {err:.3g}"


@pytest.mark.parametrize("prefill_chunk", [None, 3], ids=["one-prefill", "chunked-prefill"])
def test_greedy_tokens_equal_transformers_generate_past_the_window(hf_tiny, prefill_chunk, monkeypatch):
    ids = tokens(batch=1, seq=5)
    want, want_logits = _hf_generate(hf_tiny, ids)
    got_logits = []
    model = _ours(hf_tiny)
    # record the logits each step chooses from, through the same loop the CLI uses
    import gptoss_cli.generate.decode as decode

    real_choose = decode.choose

    def spy(logits, sampling, generator):
        got_logits.append(logits.clone())
        return real_choose(logits, sampling, generator)

    monkeypatch.setattr(decode, "choose", spy)
    (res,) = generate_ids(model, ids.tolist(), max_new_tokens=NEW, prefill_chunk=prefill_chunk)
    assert res.output_ids == want[0].tolist()
    assert res.stop_reason == MAX_NEW_TOKENS
    _assert_logits_close(torch.stack(got_logits, dim=1), want_logits)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu-kernel", "explicit-softmax"])
def test_left_padded_batch_equals_transformers_generate(hf_tiny, fused, monkeypatch):
    """Prompts of different lengths in one batch: left padding is invisible and each row's positions
    start at its own first token (transformers derives them from the attention mask). Both ways
    of attending over the cache: the CPU's fused kernel, and the explicit softmax other devices take."""
    if not fused:
        monkeypatch.setattr(kv_cache, "fused_available", lambda q: False)
    long, short = tokens(batch=1, seq=7, seed=3)[0].tolist(), tokens(batch=1, seq=2, seed=4)[0].tolist()
    ids = torch.tensor([long, [TINY.vocab_size - 2] * 5 + short])
    mask = torch.tensor([[1] * 7, [0] * 5 + [1] * 2])
    want, want_logits = _hf_generate(hf_tiny, ids, attention_mask=mask)
    got = generate_ids(_ours(hf_tiny), [long, short], max_new_tokens=NEW)
    assert [g.output_ids for g in got] == want.tolist()


def test_cached_steps_equal_recomputing_the_whole_sequence(hf_tiny):
    """Every cached step's logits equal the model's full forward over prompt + tokens so far, and a
    sliding layer never holds more than its window of keys."""
    model = _ours(hf_tiny)
    seq = tokens(batch=2, seq=4 * WINDOW, seed=5)
    cache = KVCache(model, batch=2, capacity=seq.shape[1])
    prompt = 3
    pos = torch.arange(seq.shape[1]).expand(2, -1)
    logits = prefill(model, seq[:, :prompt], pos[:, :prompt], cache)
    sliding = [c for c in cache.layers.values() if c.window is not None]
    assert sliding and any(c.window is None for c in cache.layers.values())
    for t in range(prompt, seq.shape[1]):
        with torch.no_grad():
            full = model(seq[:, :t]).logits[:, -1].float()
        _assert_logits_close(logits, full)
        logits = next_token_logits(model, forward_cached(model, seq[:, t:t + 1], pos[:, t:t + 1], cache))
        assert all(c.keys.shape[2] <= WINDOW for c in sliding)
    assert cache.max_length() == seq.shape[1]


def test_a_batch_through_the_blocked_few_row_products_equals_transformers_generate(hf_tiny, monkeypatch):
    """A batch of 6 prompts takes model/decode/skinny_gemm.py's blocked product for the LM head (6 rows) and
    for experts that get 4 or more of a step's rows, once its size threshold is lowered to the tiny
    model's and its blocks cut to 8 rows (the vocabulary's last block short): same tokens and logits
    as transformers, whose LM head is one `F.linear`."""
    from gptoss_cli.model.decode import moe as moe_decode, skinny_gemm

    monkeypatch.setattr(skinny_gemm, "BLOCKED_MIN_BYTES", 0)
    monkeypatch.setattr(skinny_gemm, "BLOCK_BYTES", 8 * TINY.hidden_size * 4)
    calls = {"head": 0, "experts": 0}
    real_mm = skinny_gemm.torch.mm

    class _CountingTorch:  # count the blocks: the LM head's have no bias (mm), an expert's have one (addmm)
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def mm(a, b, *args, **kwargs):
            calls["head"] += 1
            return real_mm(a, b, *args, **kwargs)

        @staticmethod
        def addmm(bias, a, b, *args, **kwargs):
            calls["experts"] += 1
            return torch.addmm(bias, a, b, *args, **kwargs)

    monkeypatch.setattr(skinny_gemm, "torch", _CountingTorch())
    prompts = [tokens(batch=1, seq=n, seed=10 + n)[0].tolist() for n in (7, 6, 5, 4, 3, 2)]
    width = max(len(p) for p in prompts)
    pad = TINY.vocab_size - 2
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    want, want_logits = _hf_generate(hf_tiny, ids, attention_mask=mask)
    got_logits = []
    import gptoss_cli.generate.decode as decode

    real_choose = decode.choose
    monkeypatch.setattr(decode, "choose", lambda logits, s, g: (got_logits.append(logits.clone()), real_choose(logits, s, g))[1])
    got = generate_ids(_ours(hf_tiny), prompts, max_new_tokens=NEW)
    assert [g.output_ids for g in got] == want.tolist()
    _assert_logits_close(torch.stack(got_logits, dim=1), want_logits)
    assert calls["head"] >= NEW * -(-TINY.vocab_size // 8)  # every step's head, in blocks
    assert calls["experts"] > 0, "no expert got 4 or more rows in a step: the blocked expert path did not run"
    assert moe_decode.skinny_linear is skinny_gemm.skinny_linear
