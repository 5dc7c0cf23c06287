"""Pipeline-parallel checkpoints: converted to HF they equal the PP = 1 run's bit for bit; a resumed run
continues bit for bit; a checkpoint saved at PP = 2 resumes at PP = 4 (DCP reshards every tensor by its
Hybrid name). The runs are tests/schedule/pipeline/runs.py's (shared with test_pipeline_training.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.schedule.pipeline import runs as P
from tests.schedule.pipeline.test_pipeline_training import PP_REL
from tests.train import reference as R


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return P.load(tmp_path_factory)


@pytest.mark.parametrize("to", ["hf", "hybrid"])
def test_pp_checkpoint_converts_bit_identical_with_pp1(runs, tmp_path, to):
    """Two steps at PP = 2 x EP = 2 and at PP = 1 x EP = 2 (no clip: the norm's summation order cannot
    reach the weights), each converted by `gptoss convert --to hf` / `--to hybrid`: the same tensors,
    bit for bit."""
    from gptoss_cli.checkpoint.convert import convert

    out = {}
    for name, folder in runs["checkpoints"].items():
        convert(folder, tmp_path / name, to=to, dtype="float32")
        shards = sorted((tmp_path / name).glob("*.safetensors"))
        out[name] = [(s.name, s.read_bytes()) for s in shards]
    assert len(out["ckpt-pp1-ep2"]) >= 1
    assert out["ckpt-pp2xep2"] == out["ckpt-pp1-ep2"]  # file names and bytes
    if to == "hybrid":
        shards = sorted((tmp_path / "ckpt-pp2xep2").glob("*.safetensors"))
        tensors = {k: v for shard in shards for k, v in load_file(str(shard)).items()}
        assert "decoder.layers.5.mlp.experts.linear_fc1.weight0" in tensors and "output_layer.weight" in tensors
        assert torch.equal(tensors["output_layer.weight"], runs["ckpt-pp2xep2"]["after"][-1]["output_layer.weight"])
        return
    maps = [json.loads((tmp_path / n / "model.safetensors.index.json").read_text())["weight_map"]
            for n in ("ckpt-pp2xep2", "ckpt-pp1-ep2")]
    assert maps[0] == maps[1]
    tensors = load_file(str(tmp_path / "ckpt-pp2xep2" / out["ckpt-pp2xep2"][0][0]))
    assert "model.layers.2.mlp.experts.gate_up_proj" in tensors and "lm_head.weight" in tensors
    trained = runs["ckpt-pp2xep2"]["after"][-1]
    assert torch.equal(tensors["lm_head.weight"], trained["output_layer.weight"])


def test_resume_is_bitwise(runs):
    """One step, a checkpoint, one more step from it: the weights of two steps in one go, bit for bit."""
    full, resumed = runs["resume-full"], runs["resume-b"]
    assert len(full["after"]) == 2 and len(resumed["after"]) == 1
    for name, want in full["after"][1].items():
        assert torch.equal(resumed["after"][0][name], want), name
    assert P.rank0(resumed)[-1]["loss"] == P.rank0(full)[-1]["loss"]


def test_resume_at_another_pipeline_size(runs):
    """resume-a's step-1 checkpoint (PP = 2) resumed at PP = 4: every tensor loads bit for bit, the
    step's gradients equal the PP = 2 run's within PP_REL, and its update (AdamW with the loaded
    moments) within the reference's update bound."""
    full, moved = runs["resume-full"], runs["resume-pp4"]
    for name, want in full["after"][0].items():
        assert torch.equal(moved["before"][0][name], want), name
    tensor, rel = P.max_rel_diff(moved["grads_steps"][0], full["grads_steps"][1])
    assert rel <= PP_REL, (tensor, rel)
    for name, want in full["after"][1].items():
        tol = R.ULPS * 2.0**-23 * want.abs() + R.UPDATE_ATOL
        assert ((moved["after"][0][name] - want).abs() <= tol).all(), name
