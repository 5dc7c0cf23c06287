"""Loading HybridModel from disk: HF -> convert -> Hybrid folder, and HF folders directly."""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.errors import CheckpointError
from gptoss_cli.checkpoint.load import load_hybrid, model_from_checkpoint
from tests.model.conftest import tokens
from tests.model.tiny_checkpoints import load_hf_reference, rewrite_hybrid, write_converted_pair


@pytest.fixture(scope="module", params=["bf16", "mxfp4"])
def pair(request, tmp_path_factory):
    return write_converted_pair(tmp_path_factory.mktemp(request.param), request.param)


def test_converted_checkpoint_logits_match_transformers(pair):
    hf, hybrid = pair
    ids = tokens()
    with torch.no_grad():
        expected = load_hf_reference(hf)(ids).logits
        got = model_from_checkpoint(hybrid).eval()(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_vocab_padded_checkpoint_loads_the_unpadded_rows(pair, tmp_path):
    """A Hybrid folder with Megatron's vocabulary padding (1024 rows for 1003 tokens) loads into the
    1003-row model and computes transformers' logits of the unpadded source."""
    from safetensors.torch import load_file

    from tests.model.tiny_checkpoints import write_padded_hybrid

    hf, hybrid = pair
    model = model_from_checkpoint(write_padded_hybrid(hybrid, tmp_path / "padded")).eval()
    src = load_file(str(hf / "model.safetensors"))
    assert torch.equal(model.embedding.word_embeddings.weight, src["model.embed_tokens.weight"])
    assert torch.equal(model.output_layer.weight, src["lm_head.weight"])
    ids = tokens()
    with torch.no_grad():
        expected = load_hf_reference(hf)(ids).logits
        got = model(ids).logits
    assert got.shape[-1] == 1003
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_hf_checkpoint_loads_through_the_mapping(pair):
    hf, _ = pair
    ids = tokens()
    with torch.no_grad():
        expected = load_hf_reference(hf)(ids).logits
        got = model_from_checkpoint(hf).eval()(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_expert_slice_loads_its_global_experts(pair):
    _, hybrid = pair
    full = model_from_checkpoint(hybrid)
    part = model_from_checkpoint(hybrid, expert_offset=2, num_local_experts=2)
    w_full = full.decoder.layers[3].mlp.experts.linear_fc2.weight
    assert torch.equal(part.decoder.layers[3].mlp.experts.linear_fc2.weight, w_full[2:])


def test_bf16_load_casts_parameters(pair):
    _, hybrid = pair
    model = model_from_checkpoint(hybrid, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_is_named(pair, tmp_path):
    folder = _copy(pair[1], tmp_path / "h")
    rewrite_hybrid(folder, lambda t: t.pop("decoder.layers.3.mlp.experts.linear_fc1.bias2"))
    with pytest.raises(CheckpointError, match=r"decoder\.layers\.3\.mlp\.experts\.linear_fc1\.bias2"):
        model_from_checkpoint(folder)


def test_unexpected_tensor_is_named(pair, tmp_path):
    folder = _copy(pair[1], tmp_path / "h")
    rewrite_hybrid(folder, lambda t: t.__setitem__("decoder.layers.3.mlp.experts.linear_fc1.weight9", torch.zeros(1)))
    with pytest.raises(CheckpointError, match=r"unexpected.*linear_fc1\.weight9"):
        model_from_checkpoint(folder)


def test_wrong_shape_is_named(pair, tmp_path):
    folder = _copy(pair[1], tmp_path / "h")

    def transpose_fc2(t):
        name = "decoder.layers.1.mlp.experts.linear_fc2.weight0"
        t[name] = t[name].T.contiguous()

    rewrite_hybrid(folder, transpose_fc2)
    with pytest.raises(CheckpointError, match=r"linear_fc2\.weight0 has shape \[96, 64\]"):
        model_from_checkpoint(folder)


def test_hybrid_config_for_another_architecture_is_refused(pair, tmp_path):
    import json

    folder = _copy(pair[1], tmp_path / "h")
    model = model_from_checkpoint(folder)
    cfg = json.loads((folder / "hybrid_config.json").read_text())
    cfg["architecture"]["sliding_window"] = 7
    (folder / "hybrid_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="sliding_window: 7 vs 8"):
        load_hybrid(model, folder)
