"""Hybrid -> HF: exact round trips (bf16 values; MXFP4 values and bytes) and transformers parity of the export."""

from __future__ import annotations

import json

import pytest
import torch

from gptoss_cli.checkpoint.convert import convert
from tests.checkpoint.test_convert_layout import load_all
from tests.model.tiny_checkpoints import load_hf_reference

IDS = (torch.arange(2 * 29).reshape(2, 29) * 37 + 5) % 1003  # 29 > 2 x sliding window (8)


def test_bf16_round_trip_is_exact(hf_bf16, hybrid_from_bf16, tmp_path):
    convert(str(hybrid_from_bf16), tmp_path / "back", dtype="float32")
    src, back = load_all(hf_bf16), load_all(tmp_path / "back")
    assert set(src) == set(back)
    for name, t in src.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_mxfp4_round_trip_gives_identical_bytes(hf_mxfp4, hybrid_from_mxfp4, tmp_path):
    convert(str(hybrid_from_mxfp4), tmp_path / "back", experts="mxfp4", dtype="float32")
    src, back = load_all(hf_mxfp4), load_all(tmp_path / "back")
    assert set(src) == set(back)
    for name, t in src.items():
        assert torch.equal(back[name], t), name
    assert back["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8


def test_exported_config_is_the_released_form(hybrid_from_mxfp4, tmp_path):
    convert(str(hybrid_from_mxfp4), tmp_path / "mx", experts="mxfp4")
    cfg = json.loads((tmp_path / "mx" / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss"
    assert cfg["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["truncate"] is False
    assert cfg["rope_scaling"]["factor"] == 32.0 and cfg["rope_theta"] == 150000.0
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert cfg["num_local_experts"] == 4 and cfg["intermediate_size"] == 96


@pytest.mark.parametrize("form", ["bf16", "mxfp4"])
def test_exported_hf_folder_gives_the_source_logits_in_transformers(form, hf_bf16, hf_mxfp4, hybrid_from_bf16, hybrid_from_mxfp4, tmp_path):
    src, hyb = (hf_bf16, hybrid_from_bf16) if form == "bf16" else (hf_mxfp4, hybrid_from_mxfp4)
    convert(str(hyb), tmp_path / "export", experts=form, dtype="float32")
    with torch.no_grad():
        ref = load_hf_reference(src)(IDS).logits
        ours = load_hf_reference(tmp_path / "export")(IDS).logits
    assert torch.equal(ours, ref)


def test_vocab_padding_is_stripped_on_export(hybrid_from_bf16, tmp_path):
    """Megatron pads embedding/output rows to a multiple of 128*TP; export must drop the padding."""
    import shutil

    from safetensors.torch import save_file

    padded = tmp_path / "padded"
    shutil.copytree(hybrid_from_bf16, padded)
    tensors = load_all(padded)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        t = tensors[name]
        tensors[name] = torch.cat([t, torch.full((1024 - t.shape[0], t.shape[1]), 9.0)])
    for f in padded.glob("*.safetensors"):
        f.unlink()
    (padded / "model.safetensors.index.json").unlink()
    save_file(tensors, str(padded / "model.safetensors"))
    convert(str(padded), tmp_path / "out", dtype="float32")
    out = load_all(tmp_path / "out")
    assert out["lm_head.weight"].shape[0] == 1003
    assert torch.equal(out["lm_head.weight"], load_all(hybrid_from_bf16)["output_layer.weight"])


@pytest.mark.parametrize("form", ["bf16", "mxfp4"])
def test_small_chunks_stream_the_same_bytes(form, hf_mxfp4, hybrid_from_mxfp4, tmp_path):
    """With a tiny memory budget every stack is split into single experts and row ranges."""
    convert(str(hf_mxfp4), tmp_path / "h", dtype="float32", chunk_bytes=1000)
    small, ref = load_all(tmp_path / "h"), load_all(hybrid_from_mxfp4)
    assert set(small) == set(ref) and all(torch.equal(small[k], ref[k]) for k in ref)
    convert(str(tmp_path / "h"), tmp_path / "back", experts=form, dtype="float32", chunk_bytes=1000)
    convert(str(hybrid_from_mxfp4), tmp_path / "back_ref", experts=form, dtype="float32")
    back, back_ref = load_all(tmp_path / "back"), load_all(tmp_path / "back_ref")
    assert set(back) == set(back_ref) and all(torch.equal(back[k], back_ref[k]) for k in back_ref)
