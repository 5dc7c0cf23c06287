"""Where SRC comes from: a pre-populated Hugging Face cache (offline), OpenAI's original/ layout; and atomicity."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from gptoss_cli.checkpoint import mapping
from gptoss_cli.checkpoint.convert import convert
from tests.checkpoint.test_convert_layout import load_all

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_hub_cache(cache, repo_id, src):
    """The layout huggingface_hub itself writes: refs/main -> commit -> snapshots/<commit>/files."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    shutil.copytree(src, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)


OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def add_hub_revision(cache, repo_id, src, commit, ref=None):
    """A second snapshot of the same cached repo, optionally named by a branch or tag ref."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(src, repo / "snapshots" / commit)
    if ref is not None:
        (repo / "refs" / ref).write_text(commit)


def run_cli(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "gptoss_cli", *map(str, args)], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture
def offline_env(tmp_path):
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), HF_HOME=str(tmp_path / "hf_home"))
    return env


def test_repo_id_resolves_from_the_offline_hub_cache(hf_mxfp4, hybrid_from_mxfp4, hf_bf16, hybrid_from_bf16, tmp_path,
                                                     offline_env):
    populate_hub_cache(tmp_path / "hub", "acme/gpt-oss-tiny", hf_mxfp4)
    add_hub_revision(tmp_path / "hub", "acme/gpt-oss-tiny", hf_bf16, OTHER_COMMIT)
    out = tmp_path / "out"
    r = run_cli("convert", "acme/gpt-oss-tiny", out, "--dtype", "float32", "--quiet", "--json", tmp_path / "s.json",
                env=offline_env)
    assert r.returncode == 0, r.stderr
    ours, ref = load_all(out), load_all(hybrid_from_mxfp4)
    assert set(ours) == set(ref) and all(torch.equal(ours[k], ref[k]) for k in ref)
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["source"] == "acme/gpt-oss-tiny" and summary["experts_in"] == "mxfp4"
    # the CLI passes --revision on: the other snapshot holds a different model
    r = run_cli("convert", "acme/gpt-oss-tiny", tmp_path / "o2", "--revision", OTHER_COMMIT, "--dtype", "float32",
                "--quiet", env=offline_env)
    assert r.returncode == 0, r.stderr
    ours, ref = load_all(tmp_path / "o2"), load_all(hybrid_from_bf16)
    assert set(ours) == set(ref) and all(torch.equal(ours[k], ref[k]) for k in ref)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE and HF_HUB_CACHE for this process: huggingface_hub reads its constants module."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.mark.parametrize("revision", [OTHER_COMMIT, "v2"], ids=["commit", "tag"])
def test_revision_selects_that_snapshot_not_main(revision, hf_mxfp4, hf_bf16, hybrid_from_bf16, hybrid_from_mxfp4,
                                                 tmp_path, offline_hub):
    """main holds the MXFP4 checkpoint, the other revision a different model (the bf16-form one):
    --revision must convert the other one, and record it."""
    populate_hub_cache(offline_hub, "acme/gpt-oss-tiny", hf_mxfp4)
    add_hub_revision(offline_hub, "acme/gpt-oss-tiny", hf_bf16, OTHER_COMMIT, ref="v2")
    result = convert("acme/gpt-oss-tiny", tmp_path / "out", revision=revision, dtype="float32")
    ours, want = load_all(tmp_path / "out"), load_all(hybrid_from_bf16)
    assert set(ours) == set(want) and all(torch.equal(ours[k], want[k]) for k in want)
    assert not torch.equal(ours["embedding.word_embeddings.weight"],
                           load_all(hybrid_from_mxfp4)["embedding.word_embeddings.weight"])
    assert result.experts_in == "bf16" and result.revision == revision
    provenance = json.loads((tmp_path / "out" / "hybrid_config.json").read_text())["provenance"]
    assert provenance["revision"] == revision
    convert("acme/gpt-oss-tiny", tmp_path / "main", dtype="float32")  # and without it, main
    assert load_all(tmp_path / "main")["embedding.word_embeddings.weight"].equal(
        load_all(hybrid_from_mxfp4)["embedding.word_embeddings.weight"])


def test_repo_missing_from_offline_cache_is_a_clear_error(tmp_path, offline_env):
    r = run_cli("convert", "acme/not-downloaded", tmp_path / "o", env=offline_env)
    assert r.returncode == 2
    assert "acme/not-downloaded" in r.stderr and "HF_HUB_OFFLINE" in r.stderr
    assert "Traceback" not in r.stderr


def write_openai_original(hf_folder, dst):
    """OpenAI's original/ layout, written here from the HF MXFP4 tensors by its own naming rules."""
    hf = load_all(hf_folder)
    cfg = json.loads((hf_folder / "config.json").read_text())
    out = {"embedding.weight": hf["model.embed_tokens.weight"], "norm.scale": hf["model.norm.weight"],
           "unembedding.weight": hf["lm_head.weight"]}
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"block.{i}."
        for kind in ("weight", "bias"):
            out[b + f"attn.qkv.{kind}"] = torch.cat([hf[p + f"self_attn.{x}_proj.{kind}"] for x in "qkv"])
            out[b + f"attn.out.{kind}"] = hf[p + f"self_attn.o_proj.{kind}"]
            out[b + f"mlp.gate.{kind}"] = hf[p + f"mlp.router.{kind}"]
        out[b + "attn.sinks"] = hf[p + "self_attn.sinks"]
        out[b + "attn.norm.scale"] = hf[p + "input_layernorm.weight"]
        out[b + "mlp.norm.scale"] = hf[p + "post_attention_layernorm.weight"]
        for ours, theirs in (("mlp1", "gate_up_proj"), ("mlp2", "down_proj")):
            out[b + f"mlp.{ours}_weight.blocks"] = hf[p + f"mlp.experts.{theirs}_blocks"]
            out[b + f"mlp.{ours}_weight.scales"] = hf[p + f"mlp.experts.{theirs}_scales"]
            out[b + f"mlp.{ours}_bias"] = hf[p + f"mlp.experts.{theirs}_bias"]
    (dst / "original").mkdir(parents=True)
    save_file(out, str(dst / "original" / "model.safetensors"))
    (dst / "original" / "config.json").write_text(json.dumps({
        "num_hidden_layers": cfg["num_hidden_layers"], "num_experts": cfg["num_local_experts"],
        "experts_per_token": cfg["num_experts_per_tok"], "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"], "intermediate_size": cfg["intermediate_size"], "swiglu_limit": 7.0,
        "head_dim": cfg["head_dim"], "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"], "sliding_window": cfg["sliding_window"],
        "initial_context_length": 4096, "rope_theta": 150000, "rope_scaling_factor": 32.0,
        "rope_ntk_alpha": 1.0, "rope_ntk_beta": 32.0,
    }))


def test_openai_original_layout_converts_like_the_hf_one(hf_mxfp4, hybrid_from_mxfp4, tmp_path):
    write_openai_original(hf_mxfp4, tmp_path / "repo")
    convert(str(tmp_path / "repo"), tmp_path / "out", dtype="float32")
    ours, ref = load_all(tmp_path / "out"), load_all(hybrid_from_mxfp4)
    assert set(ours) == set(ref)
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k
    cfg = json.loads((tmp_path / "out" / "hybrid_config.json").read_text())
    assert cfg["provenance"]["source_format"] == "openai-original"


def test_interrupted_conversion_leaves_no_folder(hf_bf16, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = mapping.stack_experts

    def interrupt_on_third_call(arch, per_expert):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(arch, per_expert)

    hybrid = tmp_path / "h"
    convert(str(hf_bf16), hybrid)
    monkeypatch.setattr(mapping, "TABLE", tuple(
        mapping.Mapping(m.hf, m.hybrid, m.to_hybrid, interrupt_on_third_call if m.to_hf is real else m.to_hf,
                        m.scope, m.per_expert) for m in mapping.TABLE))
    with pytest.raises(KeyboardInterrupt):
        convert(str(hybrid), tmp_path / "out")
    assert calls["n"] == 3
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["h"]


def test_tokenizer_files_travel_both_ways(hf_copy, tmp_path):
    (hf_copy / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    (hf_copy / "chat_template.jinja").write_text("{{ messages }}")
    convert(str(hf_copy), tmp_path / "h")
    convert(str(tmp_path / "h"), tmp_path / "back")
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "h" / name).read_text() == (hf_copy / name).read_text()
        assert (tmp_path / "back" / name).read_text() == (hf_copy / name).read_text()
