"""Hybrid sources and weights: hybrid_config.json is checked against the tensors; NaN/inf weights are refused."""

from __future__ import annotations

import json
import shutil
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from gptoss_cli.checkpoint.mapping import is_vocab_padding
from gptoss_cli.model.config import preset
from tests.faults.conftest import assert_one_line, gptoss, leftovers
from tests.support.cli import exit_and_output


@pytest.fixture
def hybrid_copy(tiny_hybrid, tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(tiny_hybrid, dst)
    return dst


def edit_config(folder, change) -> None:
    path = folder / "hybrid_config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


convert = partial(exit_and_output, "convert", "--quiet")


def test_a_pattern_that_does_not_describe_the_tensors_is_refused(hybrid_copy, tmp_path):
    edit_config(hybrid_copy, lambda c: c.update(hybrid_layer_pattern="*E*E*M"))
    proc = gptoss("convert", hybrid_copy, tmp_path / "out", "--quiet", cwd=tmp_path)
    assert_one_line(proc, 2, "hybrid_config.json: hybrid_layer_pattern '*E*E*M' does not describe the tensors")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("pattern, needle", [
    ("[[[**", "nested '['"),
    (123, "must be a string"),
    ("*E*E", "does not describe the tensors"),
    ("*E-E*E", "does not describe the tensors"),
])
def test_malformed_patterns_are_one_line(hybrid_copy, tmp_path, pattern, needle):
    edit_config(hybrid_copy, lambda c: c.update(hybrid_layer_pattern=pattern))
    code, out = convert(hybrid_copy, tmp_path / "out")
    assert code == 2 and needle in out and len(out.strip().splitlines()) == 1, out


def test_the_grouped_form_of_the_same_pattern_is_accepted(hybrid_copy, tmp_path):
    edit_config(hybrid_copy, lambda c: c.update(hybrid_layer_pattern="[*E][*E][*E]"))
    code, out = convert(hybrid_copy, tmp_path / "out")
    assert code == 0, out


@pytest.mark.parametrize("architecture, needle", [
    ([1, 2], "'architecture' must be a mapping of fields, got a list"),
    ("gpt-oss", "'architecture' must be a mapping of fields, got a str"),
])
def test_an_architecture_of_the_wrong_type_is_one_line(hybrid_copy, tmp_path, architecture, needle):
    edit_config(hybrid_copy, lambda c: c.update(architecture=architecture))
    code, out = convert(hybrid_copy, tmp_path / "out")
    assert code == 2 and needle in out, out


def test_a_smaller_vocab_size_is_refused_unless_the_extra_rows_are_megatron_padding(hybrid_copy, tmp_path):
    def shrink(vocab):
        def change(c):
            c["architecture"].update(vocab_size=vocab, eos_token_id=1, pad_token_id=2)
        return change

    edit_config(hybrid_copy, shrink(1000))  # 1003 stored rows: 3 real tokens would be cut
    code, out = convert(hybrid_copy, tmp_path / "out")
    assert code == 2 and "has 1003 rows but vocab_size is 1000" in out, out

    # Megatron pads 1003 -> 1024 (128 x TP=1): rows past vocab_size are padding and are stripped.
    padded = tmp_path / "padded"
    shutil.copytree(hybrid_copy, padded)
    edit_config(padded, shrink(1003))
    shard = next(padded.glob("*.safetensors"))
    tensors = load_file(shard)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        tensors[name] = torch.cat([tensors[name], torch.randn(21, tensors[name].shape[1]).to(tensors[name].dtype)])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    code, out = convert(padded, tmp_path / "hf")
    assert code == 0, out
    hf = load_file(next((tmp_path / "hf").glob("*.safetensors")))
    assert hf["model.embed_tokens.weight"].shape[0] == 1003


def test_the_padding_rule_is_the_next_multiple_of_128_times_a_tp_that_divides_the_heads():
    arch = preset("gpt_oss_120b")  # vocab 201088, 64 heads: TP in 1, 2, 4, ..., 64
    assert is_vocab_padding(201088, arch)  # no padding
    assert is_vocab_padding(201216, arch)  # TP=1, 2, 4: next multiple of 128, 256, 512
    assert is_vocab_padding(201728, arch)  # TP=8: next multiple of 1024
    assert not is_vocab_padding(201216 + 128, arch)  # 128 more rows than any TP pads
    assert not is_vocab_padding(201000, arch)  # fewer rows than tokens
    tiny = preset("tiny")  # vocab 1003, 6 heads: TP in 1, 2, 3, 6
    assert [r for r in range(1003, 2000) if is_vocab_padding(r, tiny)] == [1003, 1024, 1152, 1536]


def test_non_finite_weights_are_refused_naming_the_tensor(tiny_hf, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_hf, src)
    shard = next(src.glob("*.safetensors"))
    tensors = load_file(shard)
    name = "model.layers.1.self_attn.q_proj.weight"
    tensors[name][5, 7] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    code, out = convert(src, tmp_path / "out")
    assert code == 2 and f"tensor {name!r} holds non-finite values (first: nan at [5, 7]" in out, out
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("scale, needle", [
    (255, "holds the MXFP4 scale byte 255, which is NaN"),  # NaN by the OCP E8M0 encoding
    (254, "output tensor 'decoder.layers.1.mlp.experts.linear_fc1.weight0' holds non-finite values"),  # 6 * 2**127
])
def test_mxfp4_scales_that_decode_to_nan_or_inf_are_refused(tiny_hf, tmp_path, scale, needle):
    src = tmp_path / "src"
    shutil.copytree(tiny_hf, src)
    shard = next(src.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors["model.layers.0.mlp.experts.gate_up_proj_scales"][0, 0, 0] = scale
    tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"][0, 0, 0, 0] = 0x77  # two codes of 6.0
    save_file(tensors, str(shard), metadata={"format": "pt"})
    code, out = convert(src, tmp_path / "out")
    assert code == 2 and needle in out, out
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
