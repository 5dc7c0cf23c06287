"""gptoss parity-check on transformers-generated tiny checkpoints: passes on correct conversions
(both expert forms, both dtypes), fails naming the right block on each layout corruption."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from typer.testing import CliRunner

from gptoss_cli.cli import app
from gptoss_cli.errors import UsageError
from gptoss_cli.parity import run_parity
from tests.model.tiny_checkpoints import rewrite_hybrid, write_converted_pair

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    return write_converted_pair(tmp_path_factory.mktemp("bf16"), "bf16")


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory):
    return write_converted_pair(tmp_path_factory.mktemp("mxfp4"), "mxfp4")


@pytest.mark.parametrize("form", ["bf16", "mxfp4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_correct_conversion_passes(form, dtype, request):
    hf, hybrid = request.getfixturevalue(f"{form}_pair")
    report = run_parity(hf, hybrid, dtype=dtype, batch=2)
    assert report.passed, report.summary()
    assert report.weights.passed and report.weights.tensors_checked == 78
    assert [s.stage for s in report.stages] == ["embedding", "block 0", "block 1", "block 2"]
    assert report.seq_len > 2 * 8


def test_vocab_padded_hybrid_passes_like_the_unpadded_one(bf16_pair, tmp_path):
    """Megatron's padded embedding/output rows (1024 for 1003 tokens) are not part of the model: the
    weights match after stripping them and the forward gives the unpadded conversion's numbers."""
    from tests.model.tiny_checkpoints import write_padded_hybrid

    hf, hybrid = bf16_pair
    report = run_parity(hf, write_padded_hybrid(hybrid, tmp_path / "padded"))
    unpadded = run_parity(hf, hybrid)
    assert report.passed, report.summary()
    assert report.weights.tensors_checked == 78
    assert report.logits.kl == unpadded.logits.kl and report.logits.max_abs_diff == unpadded.logits.max_abs_diff
    assert [s.max_abs_diff for s in report.stages] == [s.max_abs_diff for s in unpadded.stages]


def test_fp32_conversion_meets_the_strict_defaults(bf16_pair):
    report = run_parity(*bf16_pair)
    assert report.logits.top1_agreement == 1.0
    assert report.logits.kl < 1e-6 and report.logits.cosine > 0.99999


def _mutated(pair, tmp_path, edit=None, config_edit=None):
    hf, hybrid = pair
    folder = tmp_path / "mutated"
    shutil.copytree(hybrid, folder)
    if edit is not None:
        rewrite_hybrid(folder, edit)
    if config_edit is not None:
        cfg = json.loads((folder / "hybrid_config.json").read_text())
        config_edit(cfg["architecture"])
        (folder / "hybrid_config.json").write_text(json.dumps(cfg))
    return hf, folder


def _swap_experts(t):
    p = "decoder.layers.3.mlp.experts."
    for kind in ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias"):
        t[p + kind + "0"], t[p + kind + "1"] = t[p + kind + "1"], t[p + kind + "0"]


def _plain_qkv(t):
    # Megatron's per-group order [q_g.., k_g, v_g] rewritten as plain q|k|v (6 heads, 2 kv, hd 16)
    for kind in ("weight", "bias"):
        name = f"decoder.layers.2.self_attention.linear_qkv.{kind}"
        grouped = t[name].reshape(2, 5, 16, *t[name].shape[1:])
        q = grouped[:, :3].reshape(96, *t[name].shape[1:])
        k = grouped[:, 3].reshape(32, *t[name].shape[1:])
        v = grouped[:, 4].reshape(32, *t[name].shape[1:])
        t[name] = torch.cat([q, k, v]).contiguous()


def _interleave_gate_up(t):
    for e in range(4):
        for kind in ("weight", "bias"):
            name = f"decoder.layers.5.mlp.experts.linear_fc1.{kind}{e}"
            gate, up = t[name].chunk(2)
            t[name] = torch.stack([gate, up], dim=1).reshape(t[name].shape).contiguous()


def _zero_sinks(t):
    name = "decoder.layers.2.self_attention.core_attention.softmax_offset"
    t[name] = torch.zeros_like(t[name])


TENSOR_MUTATIONS = {
    "two experts swapped": (_swap_experts, 1),
    "QKV rows in plain q|k|v order": (_plain_qkv, 1),
    "gate/up left interleaved": (_interleave_gate_up, 2),
    "sinks zeroed": (_zero_sinks, 1),
}


@pytest.mark.parametrize("mutation", list(TENSOR_MUTATIONS))
def test_tensor_corruption_fails_and_names_the_block(mutation, bf16_pair, tmp_path):
    edit, block = TENSOR_MUTATIONS[mutation]
    report = run_parity(*_mutated(bf16_pair, tmp_path, edit))
    assert not report.passed
    assert report.first_diverging_block == block
    assert all(s.passed for s in report.stages[: block + 1])  # embedding and earlier blocks agree
    assert report.weights.first_bad_block == block


CONFIG_MUTATIONS = {
    "sliding window off by one": lambda a: a.__setitem__("sliding_window", a["sliding_window"] - 1),
    "YaRN truncate flipped": lambda a: a.__setitem__("rope_truncate", not a["rope_truncate"]),
}


@pytest.mark.parametrize("mutation", list(CONFIG_MUTATIONS))
def test_hybrid_config_corruption_fails_at_the_first_affected_block(mutation, bf16_pair, tmp_path):
    report = run_parity(*_mutated(bf16_pair, tmp_path, config_edit=CONFIG_MUTATIONS[mutation]))
    assert not report.passed
    assert report.first_diverging_block == 0  # HF block 0 is a sliding block and uses RoPE
    assert report.architecture_differences
    assert report.weights.passed  # the tensors themselves are right


# --- bf16: which layout bugs the bf16 thresholds themselves catch ------------------------------------
def _final_norm_not_loaded(t):
    t["decoder.final_norm.weight"] = torch.ones_like(t["decoder.final_norm.weight"])


def _mutated_any(pair, tmp_path, mutation):
    if mutation in TENSOR_MUTATIONS:
        return _mutated(pair, tmp_path, TENSOR_MUTATIONS[mutation][0])
    if mutation in CONFIG_MUTATIONS:
        return _mutated(pair, tmp_path, config_edit=CONFIG_MUTATIONS[mutation])
    return _mutated(pair, tmp_path, {"final norm not loaded": _final_norm_not_loaded}[mutation])


# mutation -> the stage whose bf16 thresholds must fail first
BF16_FORWARD_CATCHES = {
    "two experts swapped": "block 1",
    "QKV rows in plain q|k|v order": "block 1",
    "gate/up left interleaved": "block 2",
    "sliding window off by one": "block 0",
    "final norm not loaded": "logits",  # the only one left to the logits thresholds
}


@pytest.mark.parametrize("mutation", list(BF16_FORWARD_CATCHES))
def test_bf16_forward_thresholds_alone_catch_layout_bugs(mutation, bf16_pair, tmp_path):
    """Without the weight check, in bf16, at the CLI's default batch: the forward thresholds must
    name the stage. (Correct bf16 conversions of these tiny models stay at hidden cosine >= 0.997,
    KL <= 1.2e-3, top-1 >= 0.89 over seeds 0-5 and both expert forms; these bugs give hidden cosine
    <= 0.94 or, for the final norm, top-1 0.73 and logits cosine 0.97.)"""
    report = run_parity(*_mutated_any(bf16_pair, tmp_path, mutation), dtype="bfloat16", check_weights_step=False)
    assert report.first_diverging == BF16_FORWARD_CATCHES[mutation], report.summary()


@pytest.mark.parametrize("mutation", ["sinks zeroed", "YaRN truncate flipped"])
def test_bf16_parity_check_fails_bugs_below_bf16_resolution_by_weights_or_config(mutation, bf16_pair, tmp_path):
    """Zeroed sinks change this model's hidden states by a median 1.5% per token even in exact fp32
    arithmetic, a flipped YaRN truncate by 0.1%: no smaller than, or far below, the 1-2% that two
    bf16 implementations differ by (the forward cannot tell them from noise, so no bf16 threshold
    can be set to catch them with a margin). A bf16 parity-check still fails them, through the
    weight check and the architecture comparison; the fp32 forward catches them too (above)."""
    report = run_parity(*_mutated_any(bf16_pair, tmp_path, mutation), dtype="bfloat16")
    assert not report.passed
    if mutation == "sinks zeroed":
        assert report.weights.first_bad_block == 1
    else:
        assert any("rope_truncate" in d for d in report.architecture_differences)


@pytest.fixture(scope="module")
def square_pair(tmp_path_factory):
    # H == I, as in the real models, so a transposed fc2 still loads and only the values are wrong
    from tests.model import tiny_checkpoints

    root = tmp_path_factory.mktemp("square")
    model = tiny_checkpoints.tiny_hf_model(0, intermediate_size=64)
    model.save_pretrained(root / "hf", safe_serialization=True)
    from gptoss_cli.checkpoint.convert import convert

    convert(str(root / "hf"), root / "hybrid", dtype="float32")
    return root / "hf", root / "hybrid"


def _transpose_fc2(t):
    for e in range(4):
        name = f"decoder.layers.5.mlp.experts.linear_fc2.weight{e}"
        t[name] = t[name].T.contiguous()


def test_fc2_transposed_fails_and_names_the_block(square_pair, tmp_path):
    report = run_parity(*_mutated(square_pair, tmp_path, _transpose_fc2))
    assert not report.passed
    assert report.first_diverging_block == 2
    assert report.weights.first_bad_block == 2


def test_fc2_transposed_is_caught_by_the_bf16_forward_thresholds(square_pair, tmp_path):
    report = run_parity(*_mutated(square_pair, tmp_path, _transpose_fc2), dtype="bfloat16", check_weights_step=False)
    assert report.first_diverging == "block 2", report.summary()


def test_fc2_transposed_with_rectangular_experts_is_a_named_shape_failure(bf16_pair, tmp_path):
    report = run_parity(*_mutated(bf16_pair, tmp_path, _transpose_fc2))
    assert not report.passed and report.first_diverging_block == 2
    assert "linear_fc2.weight0" in report.stages[-1].error


# --- CLI --------------------------------------------------------------------------------
runner = CliRunner()


def test_cli_exit_0_and_json_on_pass(bf16_pair, tmp_path):
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["parity-check", str(bf16_pair[0]), str(bf16_pair[1]), "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["passed"] and data["logits"]["top1_agreement"] == 1.0


def test_cli_exit_1_names_the_diverging_block(bf16_pair, tmp_path):
    hf, folder = _mutated(bf16_pair, tmp_path, _zero_sinks)
    result = runner.invoke(app, ["parity-check", str(hf), str(folder)])
    assert result.exit_code == 1
    assert "first diverging: block 1" in result.output


@pytest.mark.parametrize(
    "args",
    [["--dtype", "float16"], ["--tokens", "1,x"], ["--tokens", "5,99999"], ["--batch", "0"]],
)
def test_cli_exit_2_on_bad_options(bf16_pair, args):
    result = runner.invoke(app, ["parity-check", str(bf16_pair[0]), str(bf16_pair[1]), *args])
    assert result.exit_code == 2, result.output


def test_cli_exit_2_when_hybrid_folder_is_missing(bf16_pair, tmp_path):
    result = runner.invoke(app, ["parity-check", str(bf16_pair[0]), str(tmp_path / "nope")])
    assert result.exit_code == 2


def test_tokens_option_runs_those_ids(bf16_pair):
    report = run_parity(*bf16_pair, tokens="1, 2, 3, 4, 5", batch=2)
    assert (report.batch, report.seq_len) == (2, 5) and report.passed


def test_missing_transformers_names_the_extra(bf16_pair, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(UsageError) as info:
        run_parity(*bf16_pair)
    assert "pip install 'gptoss-cli[parity]'" in str(info.value)


def test_missing_and_leftover_tensors_are_listed(bf16_pair, tmp_path):
    def edit(t):
        t["decoder.layers.4.extra.weight"] = torch.zeros(2)
        del t["decoder.layers.3.mlp.router.bias"]

    report = run_parity(*_mutated(bf16_pair, tmp_path, edit))
    assert not report.passed
    assert report.weights.missing_hybrid == ["decoder.layers.3.mlp.router.bias"]
    assert report.weights.leftover_hybrid == ["decoder.layers.4.extra.weight"]
    assert report.first_diverging_block == 1
