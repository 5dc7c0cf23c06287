"""Hybrid -> HF: exact round trips (bf16 values; MXFP4 values and bytes) and transformers parity of the export."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from gptoss_cli.checkpoint.convert import convert
from tests.checkpoint.test_convert_layout import load_all
from tests.checkpoint.test_mxfp4_codec import floor_form, random_bytes
from tests.model.tiny_checkpoints import load_hf_reference

IDS = (torch.arange(2 * 29).reshape(2, 29) * 37 + 5) % 1003  # 29 > 2 x sliding window (8)


def test_bf16_round_trip_is_exact(hf_bf16, hybrid_from_bf16, tmp_path):
    convert(str(hybrid_from_bf16), tmp_path / "back", dtype="float32")
    src, back = load_all(hf_bf16), load_all(tmp_path / "back")
    assert set(src) == set(back)
    for name, t in src.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


@pytest.fixture(scope="module")
def hf_random_mxfp4(hf_mxfp4, tmp_path_factory):
    """The MXFP4 checkpoint with every expert block and scale replaced by random bytes: a source that
    never saw our encoder, as a checkpoint written by another tool (or hand-edited) would be."""
    folder = tmp_path_factory.mktemp("hf_random_mx")
    shutil.copytree(hf_mxfp4, folder, dirs_exist_ok=True)
    tensors = load_all(folder)
    for i, name in enumerate(sorted(n for n in tensors if n.endswith("_blocks"))):
        base = name.removesuffix("_blocks")
        tensors[name], tensors[base + "_scales"] = random_bytes(tuple(tensors[base + "_scales"].shape), seed=10 + i)
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_mxfp4_round_trip_of_arbitrary_bytes_gives_the_floor_form(hf_random_mxfp4, tmp_path):
    """HF (random MXFP4 bytes) -> Hybrid (bf16, the default) -> HF --experts mxfp4. Groups whose largest
    code is 4 or 6 (all a floor encoder writes) or whose scale byte is 0 come back byte for byte;
    the others come back as the floor rule writes their (unchanged) values."""
    convert(str(hf_random_mxfp4), tmp_path / "hybrid")
    convert(str(tmp_path / "hybrid"), tmp_path / "back", experts="mxfp4", dtype="float32")
    src, back = load_all(hf_random_mxfp4), load_all(tmp_path / "back")
    assert set(src) == set(back)
    kept = changed = 0
    for name in sorted(n for n in src if n.endswith("_blocks")):
        base = name.removesuffix("_blocks")
        want_blocks, want_scales = floor_form(src[name], src[base + "_scales"])
        assert torch.equal(back[name], want_blocks) and torch.equal(back[base + "_scales"], want_scales), base
        same = torch.equal(want_blocks, src[name]) and torch.equal(want_scales, src[base + "_scales"])
        kept, changed = kept + same, changed + (not same)
    assert changed  # random bytes: some groups are not in the floor form
    for name, t in src.items():
        if not name.endswith(("_blocks", "_scales")):  # the fp32 source went through bf16 in the Hybrid
            assert torch.equal(back[name], t.bfloat16().float()), name


def test_floor_encoded_groups_round_trip_byte_for_byte(hf_random_mxfp4, tmp_path):
    """Random bytes with each group's largest code forced to 4 or 6 (the floor rule's form, as in the
    released checkpoints): the whole file comes back identical."""
    folder = tmp_path / "floor"
    shutil.copytree(hf_random_mxfp4, folder)
    tensors = load_all(folder)
    for name in [n for n in tensors if n.endswith("_blocks")]:
        t = tensors[name].clone()
        t[..., 0] = (t[..., 0] & 0xF8) | (6 + (t[..., 0] & 1))  # element 0 of every group: +4.0 or +6.0
        tensors[name] = t
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    convert(str(folder), tmp_path / "hybrid")
    convert(str(tmp_path / "hybrid"), tmp_path / "back", experts="mxfp4")
    back = load_all(tmp_path / "back")
    for name, t in tensors.items():
        if name.endswith(("_blocks", "_scales")):
            assert torch.equal(back[name], t), name


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


def test_vocab_padding_is_stripped_on_export(hf_bf16, hybrid_from_bf16, tmp_path):
    """Megatron pads embedding/output rows to a multiple of 128*TP; export must drop the padding of
    both and give back the HF source's rows."""
    from tests.model.tiny_checkpoints import write_padded_hybrid

    from gptoss_cli.checkpoint.storage.safetensors_io import CheckpointReader

    padded = write_padded_hybrid(hybrid_from_bf16, tmp_path / "padded")
    with CheckpointReader(padded) as reader:
        assert reader.shape("embedding.word_embeddings.weight")[0] == reader.shape("output_layer.weight")[0] == 1024
    convert(str(padded), tmp_path / "out", dtype="float32")
    out, src = load_all(tmp_path / "out"), load_all(hf_bf16)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert out[name].shape == (1003, 64) and torch.equal(out[name], src[name]), name


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


# --- bf16-form source exported with --experts mxfp4 ------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mxfp4_export_writes_the_bytes_torchao_writes(dtype, hf_bf16, hybrid_from_bf16, tmp_path):
    """torchao's MX quantiser (float4_e2m1fn_x2, block 32, FLOOR scales) on the HF expert matrices,
    taken in their MXFP4 orientation [E, out, in] (gate/up rows interleaved) and rounded to the
    export dtype first, as the export rounds them."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    convert(str(hybrid_from_bf16), tmp_path / "mx", experts="mxfp4", dtype=dtype)
    src, out = load_all(hf_bf16), load_all(tmp_path / "mx")
    for i in range(3):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            values = src[name].transpose(1, 2).contiguous().to(getattr(torch, dtype))
            scale, data = mx.to_mx(values, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
            assert torch.equal(out[name + "_scales"], scale.view(torch.uint8).reshape(out[name + "_scales"].shape))
            assert torch.equal(out[name + "_blocks"], data.view(torch.uint8).reshape(out[name + "_blocks"].shape))


def _edit_hybrid(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_all(dst)
    edit(tensors)
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_mxfp4_export_of_a_hand_computed_group(hybrid_from_bf16, tmp_path):
    """Gate unit 0 of expert 1 (Hybrid fc1 row 0) is HF gate_up row 0 (rows alternate gate/up). Its
    first 32 inputs: amax 3 -> e = floor(log2 3) - 2 = -1 (scale byte 126); x / 2**-1 =
    [6, -1.5, 0.25, 2.5, 0...] -> codes 7, 8|3, 0 (tie to even), 4 (tie to even) -> bytes
    0x7 | 0xB << 4 = 0xB7 and 0x0 | 0x4 << 4 = 0x40."""

    def edit(t):
        w = t["decoder.layers.1.mlp.experts.linear_fc1.weight1"]
        w[0, :32] = 0.0
        w[0, :4] = torch.tensor([3.0, -0.75, 0.125, 1.25])

    folder = _edit_hybrid(hybrid_from_bf16, tmp_path / "h", edit)
    convert(str(folder), tmp_path / "mx", experts="mxfp4")
    out = load_all(tmp_path / "mx")
    assert out["model.layers.0.mlp.experts.gate_up_proj_scales"][1, 0, 0] == 126
    assert out["model.layers.0.mlp.experts.gate_up_proj_blocks"][1, 0, 0].tolist() == [0xB7, 0x40] + [0] * 14


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("chunk_bytes", [128 * 1024**2, 1000], ids=["all-experts-chunk", "one-expert-chunks"])
def test_non_finite_expert_exported_as_mxfp4_is_an_error_naming_the_tensor(bad, chunk_bytes, hybrid_from_bf16, tmp_path):
    from gptoss_cli.errors import CheckpointError

    def edit(t):
        t["decoder.layers.3.mlp.experts.linear_fc2.weight2"][5, 7] = bad

    folder = _edit_hybrid(hybrid_from_bf16, tmp_path / "h", edit)
    with pytest.raises(CheckpointError) as info:
        convert(str(folder), tmp_path / "mx", experts="mxfp4", chunk_bytes=chunk_bytes)
    message = str(info.value)
    # refused as read from the source, before MXFP4 encoding (which has no NaN/Inf either)
    assert "tensor 'decoder.layers.3.mlp.experts.linear_fc2.weight2' holds non-finite values" in message
    assert f"first: {bad} at [5, 7]" in message
    assert "\n" not in message
    assert not (tmp_path / "mx").exists() and [p.name for p in tmp_path.iterdir()] == ["h"]


def test_non_finite_expert_through_the_cli_is_one_line_and_exit_2(hybrid_from_bf16, tmp_path):
    from typer.testing import CliRunner

    from gptoss_cli.cli import app

    def edit(t):
        t["decoder.layers.5.mlp.experts.linear_fc1.weight0"][0, 0] = float("nan")

    folder = _edit_hybrid(hybrid_from_bf16, tmp_path / "h", edit)
    result = CliRunner().invoke(app, ["convert", str(folder), str(tmp_path / "mx"), "--experts", "mxfp4", "--quiet"])
    assert result.exit_code == 2
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and "decoder.layers.5.mlp.experts.linear_fc1.weight0" in lines[0], result.output
