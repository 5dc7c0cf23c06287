"""Megatron-LM torch_dist checkpoints: `convert --to megatron`, reading Megatron's own saves, and bad input.

References: megatron-core's dist_checkpointing (load with StrictHandling.RAISE_ALL; save at EP=1 and
EP=2, stacked and singleton_local_shards expert layouts) run on CPU with gloo in a subprocess
(tests/checkpoint/megatron_worker.py); torch.load / torch's DCP reader for the bytes; the HF
tensors themselves for values. Byte-level checks hold without megatron-core.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gptoss_cli.checkpoint.convert import convert
from gptoss_cli.checkpoint.storage.dcp_io import read_metadata
from gptoss_cli.checkpoint.load import model_from_checkpoint
from tests.checkpoint import megatron_worker as ref
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(str(folder / "*.safetensors"))):
        out.update(load_file(f))
    return out


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def hf_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def assert_same_architecture(a: Path, b: Path) -> None:
    """The HF configs of two folders describe the same network (layer types, window, rope, sizes, ...)."""
    from gptoss_cli.checkpoint.formats.hf.config import from_hf_config

    assert from_hf_config(hf_config(a)).differences(from_hf_config(hf_config(b))) == []


def worker(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.checkpoint.megatron_worker", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def megatron_out(hf_bf16, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("mg") / "megatron"
    convert(str(hf_bf16), dst, to="megatron", dtype="float32")
    return dst


def common(folder: Path) -> dict:
    """common.pt as Megatron-LM reads it: plain torch.load (we wrote it, so it is trusted here)."""
    return torch.load(folder / "release" / "common.pt", weights_only=False)


# --- the files, byte-level ---------------------------------------------------------------
def test_folder_tracker_metadata_json_and_common_pt(megatron_out, hf_bf16):
    cfg = hf_config(hf_bf16)
    assert (megatron_out / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    folder = megatron_out / "release"
    assert json.loads((folder / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
        "common_backend_version": 1}
    c = common(megatron_out)
    assert c["checkpoint_version"] == 3.0 and c["iteration"] == 0
    args = c["args"]
    assert isinstance(args, argparse.Namespace)
    L = cfg["num_hidden_layers"]
    assert args.num_layers == 2 * L and args.hybrid_override_pattern == "*E" * L
    assert (args.hidden_size, args.num_attention_heads, args.num_query_groups, args.kv_channels) == (
        cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (
        cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"])
    assert args.vocab_size == cfg["vocab_size"] == 1003
    assert args.padded_vocab_size == 1024 and args.make_vocab_size_divisible_by == 128
    assert args.window_size == (cfg["sliding_window"] - 1, 0)
    # Megatron's rule (transformer/utils.py is_layer_window_attention): list entry n-1 says whether layer n slides
    sliding = [t == "sliding_attention" for t in cfg["layer_types"]]
    assert args.window_attn_skip_freq == [x for s in sliding for x in (int(s), 0)]
    assert args.tensor_model_parallel_size == args.pipeline_model_parallel_size == 1
    assert args.untie_embeddings_and_output_weights and args.add_qkv_bias and args.swiglu


def test_keys_global_shapes_and_expert_chunks(megatron_out, hf_bf16):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    cfg = hf_config(hf_bf16)
    E, H, I, L = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    md = read_metadata(megatron_out / "release").state_dict_metadata
    tensors = {k: v for k, v in md.items() if not isinstance(v, BytesStorageMetadata)}
    objects = {k for k, v in md.items() if isinstance(v, BytesStorageMetadata)}
    plain = ref._plain_tensors(hf_tensors(hf_bf16), cfg, 1024)  # Megatron's names from the HF layout
    expert_keys = {f"decoder.layers.{2 * b + 1}.mlp.experts.experts.linear_fc{n}.{kind}"
                   for b in range(L) for n in (1, 2) for kind in ("weight", "bias")}
    assert set(tensors) == set(plain) | expert_keys
    for k, t in plain.items():
        assert tuple(md[k].size) == tuple(t.shape), k
        assert [(tuple(c.offsets), tuple(c.sizes)) for c in md[k].chunks][0][0] == (0,) * t.dim()
    assert tuple(md["embedding.word_embeddings.weight"].size) == (1024, H)
    fc1 = md["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"]
    assert tuple(fc1.size) == (E, 2 * I, H)
    # each expert two chunks, gate half then up half (megatron-core's apply_swiglu_sharded_factory)
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in fc1.chunks) == sorted(
        [((e, 0, 0), (1, I, H)) for e in range(E)] + [((e, I, 0), (1, I, H)) for e in range(E)])
    fc2b = md["decoder.layers.1.mlp.experts.experts.linear_fc2.bias"]
    assert tuple(fc2b.size) == (E, H)
    assert sorted(tuple(c.offsets) for c in fc2b.chunks) == [(e, 0) for e in range(E)]
    # _extra_state objects: megatron-core's ShardedObject.unique_key, key/shard_<offset>_<shape>
    assert "decoder.layers.0.self_attention.linear_qkv._extra_state/shard_0_1" in objects
    assert "decoder.layers.0.self_attention.core_attention._extra_state/shard_0_1" in objects
    assert f"decoder.layers.{2 * L - 1}.mlp.experts.experts.linear_fc2._extra_state/shard_{E - 1}_{E}" in objects
    assert "output_layer._extra_state/shard_0_1" in objects
    assert len(objects) == L * (3 + 1 + 2 * E) + 2  # + the final norm's and the output layer's


def test_torch_dcp_reads_the_hf_values_and_zero_padding(megatron_out, hf_bf16):
    """torch's own DCP loader (not ours) reads every tensor; values are the HF ones, padding rows zero."""
    import torch.distributed.checkpoint as dcp

    cfg = hf_config(hf_bf16)
    hf = hf_tensors(hf_bf16)
    md = read_metadata(megatron_out / "release").state_dict_metadata
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.items()
             if hasattr(v, "size")}
    dcp.load(state, checkpoint_id=str(megatron_out / "release"), no_dist=True)
    plain = ref._plain_tensors(hf, cfg, 1024)
    for k, t in plain.items():
        assert torch.equal(state[k], t), k
    assert not state["output_layer.weight"][1003:].any()
    for b in range(cfg["num_hidden_layers"]):
        for e in range(cfg["num_local_experts"]):
            want = ref._expert_params(hf, b, e)
            for n, t in want.items():
                assert torch.equal(state[f"decoder.layers.{2 * b + 1}.mlp.experts.experts.{n}"][e], t), (b, e, n)


def test_vocab_multiple_option_pads_to_it(hf_bf16, tmp_path):
    dst = tmp_path / "mg"
    convert(str(hf_bf16), dst, to="megatron", dtype="float32", vocab_multiple=100)
    md = read_metadata(dst / "release").state_dict_metadata
    assert tuple(md["output_layer.weight"].size)[0] == 1100
    assert common(dst)["args"].padded_vocab_size == 1100
    back = tmp_path / "hf"
    convert(str(dst), back, to="hf", dtype="float32")
    assert_same_tensors(hf_tensors(back), hf_tensors(hf_bf16))


# --- round trips -------------------------------------------------------------------------
def test_hf_to_megatron_to_hf_is_bit_identical(megatron_out, hf_bf16, tmp_path):
    convert(str(megatron_out), tmp_path / "hf", to="hf", dtype="float32")
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(hf_bf16))
    assert_same_architecture(tmp_path / "hf", hf_bf16)


def test_mxfp4_source_round_trips_through_megatron_as_through_hybrid(hf_mxfp4, hybrid_from_mxfp4, tmp_path):
    convert(str(hf_mxfp4), tmp_path / "mg", to="megatron", dtype="float32")
    convert(str(tmp_path / "mg"), tmp_path / "via_mg", to="hf", experts="mxfp4", dtype="float32")
    convert(str(hybrid_from_mxfp4), tmp_path / "via_hyb", to="hf", experts="mxfp4", dtype="float32")
    assert_same_tensors(hf_tensors(tmp_path / "via_mg"), hf_tensors(tmp_path / "via_hyb"))
    assert_same_tensors(hf_tensors(tmp_path / "via_mg"), hf_tensors(hf_mxfp4))


def test_hybrid_and_megatron_sources_write_the_same_megatron_tensors(megatron_out, hybrid_from_bf16, tmp_path):
    import torch.distributed.checkpoint as dcp

    convert(str(hybrid_from_bf16), tmp_path / "from_hybrid", to="megatron", dtype="float32")
    convert(str(megatron_out), tmp_path / "again", to="megatron", dtype="float32")
    md = read_metadata(megatron_out / "release").state_dict_metadata
    states = []
    for folder in (megatron_out, tmp_path / "from_hybrid", tmp_path / "again"):
        s = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.items() if hasattr(v, "size")}
        dcp.load(s, checkpoint_id=str(folder / "release"), no_dist=True)
        states.append(s)
    for s in states[1:]:
        assert_same_tensors(s, states[0])


def test_pretrained_weights_from_a_megatron_checkpoint(megatron_out, hf_bf16):
    a = model_from_checkpoint(megatron_out)
    b = model_from_checkpoint(hf_bf16)
    assert a.pattern.text == b.pattern.text
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# --- megatron-core as the reference ------------------------------------------------------
def test_megatron_core_loads_our_output_strictly(megatron_out, hf_bf16, tmp_path):
    pytest.importorskip("megatron.core")
    out = tmp_path / "loaded.safetensors"
    worker("load", str(megatron_out / "release"), str(out))
    loaded = load_file(out)
    cfg = hf_config(hf_bf16)
    hf = hf_tensors(hf_bf16)
    want = ref._plain_tensors(hf, cfg, 1024)
    for b in range(cfg["num_hidden_layers"]):
        for e in range(cfg["num_local_experts"]):
            for n, t in ref._expert_params(hf, b, e).items():
                want[f"decoder.layers.{2 * b + 1}.mlp.experts.local_experts.{e}.{n}"] = t
    assert_same_tensors(loaded, want)
    info = json.loads(Path(str(out) + ".json").read_text())
    assert info["checkpoint_version"] == 3.0 and info["iteration"] == 0


# What the Transformer Engine spec adds to the local spec's requests: TEDotProductAttention and TENorm carry
# _extra_state, their local counterparts (DotProductAttention, torch's RMSNorm) do not.
TE_ONLY = ("self_attention.core_attention._extra_state", "pre_mlp_layernorm._extra_state", "final_norm._extra_state")


def test_megatron_core_model_loads_every_key_it_asks_for_and_computes_transformers_logits(megatron_out, hf_bf16,
                                                                                          tmp_path):
    """megatron-core's own MambaModel ('*E' hybrid stack, local spec) built from our args, loaded by its own
    dist_checkpointing.load at EP=2 and at EP=1 (2 gloo ranks): nothing it asks for is absent (0.16.1 stopped
    at "Missing key in checkpoint state_dict: output_layer._extra_state/shard_0_1"), and its logits are
    transformers' on the HF checkpoint the conversion started from."""
    pytest.importorskip("megatron.core")
    from tests.model.tiny_checkpoints import load_hf_reference
    from tests.tolerances import reassociation_rel

    out = tmp_path / "logits.safetensors"
    worker("model", str(megatron_out / "release"), str(out), "2")
    report = json.loads(Path(str(out) + ".json").read_text())
    logits = load_file(out)
    cfg = hf_config(hf_bf16)
    with torch.no_grad():
        want = load_hf_reference(hf_bf16).eval()(torch.tensor(ref.TOKENS)).logits  # [batch, seq, vocab]
    rel = reassociation_rel(max(cfg["hidden_size"], cfg["intermediate_size"]), depth=4 * cfg["num_hidden_layers"])
    for ep in (2, 1):
        found = report[f"ep{ep}"]
        assert found["absent"] == [], found["absent"]
        assert found["not_asked"] and all(k.endswith(TE_ONLY) for k in found["not_asked"]), found["not_asked"]
        assert "output_layer._extra_state" in found["requested"]
        got = logits[f"logits_ep{ep}"][..., :cfg["vocab_size"]]  # [batch, seq, padded vocab]: the padding dropped
        err = (got - want).abs().max().item()
        assert err <= rel * want.abs().max().item(), (ep, err)
        assert not logits[f"logits_ep{ep}"][..., cfg["vocab_size"]:].any()  # the padding rows are zero


@pytest.mark.parametrize("ep,singleton", [(1, False), (2, False), (2, True)])
def test_what_megatron_core_saves_converts_back_to_the_same_hf_weights(ep, singleton, hf_bf16, tmp_path):
    pytest.importorskip("megatron.core")
    saved = tmp_path / "megatron"
    worker("save", str(hf_bf16), str(saved), str(ep), "1" if singleton else "0")
    result = convert(str(saved), tmp_path / "hf", to="hf", dtype="float32")
    assert result.provenance["expert_layout"] == ("singleton" if singleton else "stacked")
    assert result.provenance["megatron_iteration"] == 7
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(hf_bf16))
    assert_same_architecture(tmp_path / "hf", hf_bf16)  # from the args megatron-core saved


# --- bad input ---------------------------------------------------------------------------
def run_convert(src, dst, *extra):
    result = run_cli("convert", src, dst, "--quiet", *extra)
    return result, result.output


def assert_clean_failure(result, output, *needles, dst):
    assert result.exit_code == 2, output
    assert len([line for line in output.splitlines() if line.strip()]) == 1, output
    for needle in needles:
        assert needle in output, (needle, output)
    assert not dst.exists() and not list(dst.parent.glob(f".{dst.name}.partial-*"))


@pytest.fixture
def mg_copy(megatron_out, tmp_path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(megatron_out, dst)
    return dst


def _rewrite_common(folder: Path, edit) -> None:
    c = torch.load(folder / "release" / "common.pt", weights_only=False)
    edit(c)
    torch.save(c, folder / "release" / "common.pt")


def test_missing_shard_is_one_line(mg_copy, tmp_path):
    (mg_copy / "release" / "__0_0.distcp").unlink()
    r, out = run_convert(mg_copy, tmp_path / "o", "--to", "hf")
    assert_clean_failure(r, out, "__0_0.distcp", "is missing", dst=tmp_path / "o")


def test_tensor_parallel_checkpoint_is_refused(mg_copy, tmp_path):
    _rewrite_common(mg_copy, lambda c: setattr(c["args"], "tensor_model_parallel_size", 2))
    r, out = run_convert(mg_copy, tmp_path / "o", "--to", "hf")
    assert_clean_failure(r, out, "tensor_model_parallel_size=2", "TP=1", dst=tmp_path / "o")


def test_unknown_backend_is_refused(mg_copy, tmp_path):
    (mg_copy / "release" / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    r, out = run_convert(mg_copy, tmp_path / "o", "--to", "hf")
    assert_clean_failure(r, out, "sharded_backend is 'zarr'", dst=tmp_path / "o")


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_pickle_that_would_run_code_is_refused(mg_copy, tmp_path):
    marker = tmp_path / "ran"
    (mg_copy / "release" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    r, out = run_convert(mg_copy, tmp_path / "o", "--to", "hf")
    assert_clean_failure(r, out, ".metadata", "refusing to load", dst=tmp_path / "o")
    assert not marker.exists()


def test_common_pt_code_is_never_run_and_args_still_read(mg_copy, tmp_path):
    marker = tmp_path / "ran"
    _rewrite_common(mg_copy, lambda c: setattr(c["args"], "hook", _RunsCode(marker)))
    result = convert(str(mg_copy), tmp_path / "o", to="hf", dtype="float32")
    assert result.num_tensors > 0 and not marker.exists()


def test_extra_state_bytes_are_never_unpickled(mg_copy, tmp_path):
    """Overwrite one _extra_state payload with a pickle that would run code: conversion never reads it."""
    marker = tmp_path / "ran"
    folder = mg_copy / "release"
    md = read_metadata(folder)
    index, info = next((i, s) for i, s in md.storage_data.items() if "_extra_state" in i.fqn)
    payload = io.BytesIO()
    torch.save([_RunsCode(marker)], payload)
    data = bytearray((folder / info.relative_path).read_bytes())
    blob = payload.getvalue()
    with open(folder / info.relative_path, "ab") as f:  # append the payload and point the entry at it
        f.write(blob)
    info.offset, info.length = len(data), len(blob)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    convert(str(mg_copy), tmp_path / "o", to="hf", dtype="float32")
    assert not marker.exists()


def test_vocab_multiple_needs_megatron_output(hf_bf16, tmp_path):
    r, out = run_convert(hf_bf16, tmp_path / "o", "--vocab-multiple", "64")
    assert_clean_failure(r, out, "--vocab-multiple applies to --to megatron only", dst=tmp_path / "o")


def test_force_replaces_a_previous_megatron_output_only(hf_bf16, megatron_out, tmp_path):
    dst = tmp_path / "mg"
    shutil.copytree(megatron_out, dst)
    r, out = run_convert(hf_bf16, dst, "--to", "megatron", "--force")
    assert r.exit_code == 0, out
    (dst / "notes.txt").write_text("mine")
    r, out = run_convert(hf_bf16, dst, "--to", "megatron", "--force")
    assert r.exit_code == 2 and "notes.txt" in out


def test_tracker_naming_an_iteration_folder(megatron_out, hf_bf16, tmp_path):
    src = tmp_path / "run"
    shutil.copytree(megatron_out / "release", src / "iter_0000042")
    (src / "latest_checkpointed_iteration.txt").write_text("42\n")
    convert(str(src), tmp_path / "hf", to="hf", dtype="float32")
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(hf_bf16))
    (src / "latest_checkpointed_iteration.txt").write_text("43\n")
    r, out = run_convert(src, tmp_path / "o", "--to", "hf")
    assert_clean_failure(r, out, "iter_0000043, which does not exist", dst=tmp_path / "o")


def test_an_expert_parallel_rank_reads_only_its_experts(megatron_out, hf_bf16, monkeypatch):
    """checkpoint.pretrained at EP=2: rank 1's model (experts 2..3) gets the HF weights of exactly those."""
    from gptoss_cli.checkpoint.formats.megatron import reader as megatron_reader
    from gptoss_cli.checkpoint.load import checkpoint_architecture, load_weights
    from gptoss_cli.model.build import build_model

    arch, _ = checkpoint_architecture(megatron_out)
    read = []
    real = megatron_reader.MegatronReader.read
    monkeypatch.setattr(megatron_reader.MegatronReader, "read",
                        lambda self, name, *a: read.append(name) or real(self, name, *a))
    a = build_model(arch, expert_offset=2, num_local_experts=2)
    load_weights(a, megatron_out)
    b = build_model(arch, expert_offset=2, num_local_experts=2)
    load_weights(b, hf_bf16)
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not [n for n in read if n.endswith(("weight0", "weight1", "bias0", "bias1"))]


def test_recipe_model_checkpoint_reads_the_architecture_from_megatron_args(megatron_out, hf_bf16):
    from gptoss_cli.checkpoint.formats.hf.config import from_hf_config
    from gptoss_cli.recipe.load import architecture_from_checkpoint

    arch, pattern = architecture_from_checkpoint(megatron_out)
    assert arch.differences(from_hf_config(hf_config(hf_bf16))) == []
    assert pattern == "*E" * arch.num_hidden_layers


@pytest.mark.parametrize("field,value", [("window_size", _RunsCode(Path("/nonexistent/x"))), ("norm_epsilon", "tiny"),
                                         ("hybrid_override_pattern", "*-*-"), ("num_experts", None)])
def test_args_that_describe_no_gpt_oss_model_are_one_line(field, value, mg_copy, tmp_path):
    _rewrite_common(mg_copy, lambda c: setattr(c["args"], field, value))
    r, out = run_convert(mg_copy, tmp_path / "o", "--to", "hf")
    assert_clean_failure(r, out, "common.pt", dst=tmp_path / "o")


@pytest.mark.parametrize("field", ["window_size", "window_attn_skip_freq", "max_position_embeddings"])
def test_args_that_cannot_say_the_architecture_are_one_line_unless_it_comes_from_elsewhere(field, mg_copy, hf_bf16,
                                                                                           tmp_path):
    """Args without the sliding window or the position limit were read as full attention everywhere and
    GPT-OSS's 131072 positions; now: one line naming the field, or --arch-from (an HF config.json or a
    preset), or Megatron-Bridge's run_config.yaml beside the weights (its `model:` names: seq_length)."""
    recorded = {}
    _rewrite_common(mg_copy, lambda c: recorded.update(vars(c["args"])) or delattr(c["args"], field))
    r, out = run_convert(mg_copy, tmp_path / "o", "--to", "hf")
    assert_clean_failure(r, out, f"args record no {field}", "--arch-from", dst=tmp_path / "o")
    r, out = run_convert(mg_copy, tmp_path / "o", "--to", "hf", "--arch-from", hf_bf16 / "config.json")
    assert r.exit_code == 0, out
    assert_same_architecture(tmp_path / "o", hf_bf16)
    r, out = run_convert(mg_copy, tmp_path / "o2", "--to", "hf", "--arch-from", "gpt_oss_20b")  # another model
    assert_clean_failure(r, out, "--arch-from disagree", "num_hidden_layers", dst=tmp_path / "o2")
    bridge = {"max_position_embeddings": "seq_length"}.get(field, field)
    value = list(recorded[field]) if isinstance(recorded[field], (list, tuple)) else recorded[field]
    (mg_copy / "release" / "run_config.yaml").write_text(json.dumps({"model": {bridge: value}}))  # YAML holds JSON
    convert(str(mg_copy), tmp_path / "o3", to="hf", dtype="float32")
    assert_same_architecture(tmp_path / "o3", hf_bf16)


def test_streams_in_chunks_both_ways(hf_bf16, tmp_path, monkeypatch):
    """With a 4 KiB chunk budget the embedding (and its padding) is written as row chunks of at most that
    size, and reading back never loads a stored chunk bigger than one expert half, one row range or the
    largest tensor group convert holds anyway."""
    from gptoss_cli.checkpoint.formats.megatron import reader as megatron_reader

    budget = 4096
    convert(str(hf_bf16), tmp_path / "mg", to="megatron", dtype="float32", chunk_bytes=budget)
    md = read_metadata(tmp_path / "mg" / "release").state_dict_metadata
    emb = md["embedding.word_embeddings.weight"]
    H = emb.size[1]
    assert len(emb.chunks) > 10 and max(c.sizes[0] * H * 4 for c in emb.chunks) <= max(budget, H * 4)
    loaded = []
    real = megatron_reader.MegatronReader._chunk
    monkeypatch.setattr(megatron_reader.MegatronReader, "_chunk",
                        lambda self, k, o, s: loaded.append(torch.Size(s).numel() * 4) or real(self, k, o, s))
    convert(str(tmp_path / "mg"), tmp_path / "hf", to="hf", dtype="float32", chunk_bytes=budget)
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(hf_bf16))
    cfg = hf_config(hf_bf16)
    qkv_rows = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * cfg["head_dim"]
    # a row range, an expert half, or one tensor group that convert holds whole anyway (the fused qkv)
    assert max(loaded) <= max(budget, cfg["intermediate_size"] * cfg["hidden_size"] * 4, qkv_rows * cfg["hidden_size"] * 4)


def test_metadata_pickled_as_megatron_core_015_mcore_metadata_is_read_without_megatron(mg_copy, hf_bf16, tmp_path):
    """megatron-core 0.15 pickled its own MCoreMetadata class into .metadata; it loads as an inert stand-in."""
    strategies = pytest.importorskip("megatron.core.dist_checkpointing.strategies.torch")
    folder = mg_copy / "release"
    md = read_metadata(folder)
    old = strategies.MCoreMetadata()
    old.__dict__.update(vars(md), mcore_data={"some.key": {"nd_reformulated_orig_global_shape": None}})
    blob = pickle.dumps(old)
    assert b"MCoreMetadata" in blob and b"megatron.core" in blob
    (folder / ".metadata").write_bytes(blob)
    removed = {m: sys.modules.pop(m) for m in [m for m in sys.modules if m.startswith("megatron")]}
    try:  # the read imports nothing of megatron
        convert(str(mg_copy), tmp_path / "hf", to="hf", dtype="float32")
        assert not [m for m in sys.modules if m.startswith("megatron")]
    finally:
        sys.modules.update(removed)
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(hf_bf16))


def test_megatron_core_experts_compute_transformers_expert_outputs(megatron_out, hf_bf16, tmp_path):
    """megatron-core's MLP experts, configured from our args as Megatron-LM configures GPT-OSS (quick_gelu
    gate, clamp, +1 on the linear half) and loaded from our checkpoint, give transformers' per-expert
    outputs: the gate/up order and orientation of fc1/fc2 are what Megatron computes with."""
    pytest.importorskip("megatron.core")
    from safetensors.torch import save_file

    from tests.model.tiny_checkpoints import load_hf_reference
    from tests.tolerances import reassociation_rel

    cfg = hf_config(hf_bf16)
    H, I, E = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(3)) * 2  # big enough to reach the clamp
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    out = tmp_path / "loaded.safetensors"
    worker("load", str(megatron_out / "release"), str(out), str(tmp_path / "x.safetensors"))
    got = load_file(out)
    model = load_hf_reference(hf_bf16)
    rel = reassociation_rel(max(H, I), depth=2)
    with torch.no_grad():
        for b, layer in enumerate(model.model.layers):
            for e in range(E):
                want = layer.mlp.experts(x, torch.full((x.shape[0], 1), e), torch.ones(x.shape[0], 1))
                err = (got[f"expert_out.{b}.{e}"] - want).abs().max().item()
                assert err <= rel * want.abs().max().item(), (b, e, err)
