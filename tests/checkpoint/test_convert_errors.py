"""Bad input: one clear line naming the culprit, exit code 2, no traceback, and nothing left at DST."""

from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from gptoss_cli.checkpoint.storage import safetensors_io
from gptoss_cli.checkpoint.convert import convert
from tests.checkpoint.test_convert_layout import load_all
from tests.support.cli import run_cli


def run_convert(src, dst, *extra):
    result = run_cli("convert", src, dst, "--quiet", *extra)
    return result, result.output  # stdout and stderr, interleaved


def assert_clean_failure(result, output, *needles, dst=None):
    assert result.exit_code == 2, output
    assert "Traceback" not in output and result.exception is None or isinstance(result.exception, SystemExit)
    assert len([line for line in output.splitlines() if line.strip()]) == 1, output
    for needle in needles:
        assert needle in output, (needle, output)
    if dst is not None:
        assert not dst.exists()
        assert not list(dst.parent.glob(f".{dst.name}.partial-*"))


def rewrite(folder, change):
    tensors = load_all(folder)
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture
def sharded_src(hybrid_from_bf16, tmp_path):
    dst = tmp_path / "sharded"
    convert(str(hybrid_from_bf16), dst, dtype="float32", max_shard_bytes=200_000)
    assert len(list(dst.glob("model-*.safetensors"))) > 2
    return dst


def test_missing_config(hf_copy, tmp_path):
    (hf_copy / "config.json").unlink()
    r, out = run_convert(hf_copy, tmp_path / "o")
    assert_clean_failure(r, out, "no config.json", dst=tmp_path / "o")


def test_unsupported_model_type(hf_copy, tmp_path):
    cfg = json.loads((hf_copy / "config.json").read_text())
    cfg["model_type"] = "llama"
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    r, out = run_convert(hf_copy, tmp_path / "o")
    assert_clean_failure(r, out, "model_type is 'llama'", "config.json", dst=tmp_path / "o")


def test_missing_shard(sharded_src, tmp_path):
    victim = sorted(sharded_src.glob("model-*.safetensors"))[1]
    victim.unlink()
    r, out = run_convert(sharded_src, tmp_path / "o")
    assert_clean_failure(r, out, victim.name, "missing", dst=tmp_path / "o")


def test_truncated_shard(sharded_src, tmp_path):
    victim = sorted(sharded_src.glob("model-*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:-100])
    r, out = run_convert(sharded_src, tmp_path / "o")
    assert_clean_failure(r, out, victim.name, "truncated", dst=tmp_path / "o")


def test_corrupt_header(hf_copy, tmp_path):
    f = hf_copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:16] = b"\xff\xfe{{not"
    f.write_bytes(bytes(data))
    r, out = run_convert(hf_copy, tmp_path / "o")
    assert_clean_failure(r, out, "model.safetensors", "corrupt safetensors header", dst=tmp_path / "o")


def test_missing_tensor(hf_copy, tmp_path):
    rewrite(hf_copy, lambda t: t.pop("model.layers.1.self_attn.sinks"))
    r, out = run_convert(hf_copy, tmp_path / "o")
    assert_clean_failure(r, out, "model.layers.1.self_attn.sinks", "missing", dst=tmp_path / "o")


def test_unexpected_tensor(hf_copy, tmp_path):
    rewrite(hf_copy, lambda t: t.update({"model.layers.0.mlp.shared_expert.weight": torch.zeros(3)}))
    r, out = run_convert(hf_copy, tmp_path / "o")
    assert_clean_failure(r, out, "model.layers.0.mlp.shared_expert.weight", "unexpected", dst=tmp_path / "o")


def test_wrong_shape(hf_copy, tmp_path):
    def transpose_down(t):
        name = "model.layers.2.mlp.experts.down_proj"
        t[name] = t[name].transpose(1, 2).contiguous()

    rewrite(hf_copy, transpose_down)
    r, out = run_convert(hf_copy, tmp_path / "o")
    assert_clean_failure(r, out, "model.layers.2.mlp.experts.down_proj", "[4, 64, 96]", "[4, 96, 64]", dst=tmp_path / "o")


def test_wrong_dtype(hf_copy, tmp_path):
    def to_int(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)

    rewrite(hf_copy, to_int)
    r, out = run_convert(hf_copy, tmp_path / "o")
    assert_clean_failure(r, out, "model.norm.weight", "torch.int32", dst=tmp_path / "o")


def test_index_pointing_outside_src(sharded_src, tmp_path):
    index_path = sharded_src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = "../../etc/passwd"
    index_path.write_text(json.dumps(index))
    r, out = run_convert(sharded_src, tmp_path / "o")
    assert_clean_failure(r, out, "lm_head.weight", "outside the checkpoint folder", dst=tmp_path / "o")


def test_full_disk_while_writing_leaves_nothing(hf_bf16, tmp_path, monkeypatch):
    real_open = open

    class FullDisk:
        """Shard files opened for writing accept a few writes, then the disk is full."""

        def __new__(cls, path, mode="r", *a, **k):
            if "w" not in mode:
                return real_open(path, mode, *a, **k)
            return super().__new__(cls)

        def __init__(self, *a, **k):
            self.calls = 0

        def write(self, data):
            self.calls += 1
            if self.calls > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return len(data)

        def close(self):
            pass

    monkeypatch.setattr(safetensors_io, "open", FullDisk, raising=False)
    r, out = run_convert(hf_bf16, tmp_path / "o")
    assert_clean_failure(r, out, "disk full", dst=tmp_path / "o")


def test_not_enough_free_space_is_refused_before_writing(hf_bf16, tmp_path, monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    r, out = run_convert(hf_bf16, tmp_path / "o")
    assert_clean_failure(r, out, "not enough disk space", dst=tmp_path / "o")


def test_existing_destination_is_refused_without_force(hf_bf16, tmp_path):
    dst = tmp_path / "o"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    r, out = run_convert(hf_bf16, dst)
    assert r.exit_code == 2 and "--force" in out
    assert (dst / "keep.txt").read_text() == "precious"
    # --force replaces only a previous gptoss output of the same kind (or an empty folder)
    r, out = run_convert(hf_bf16, dst, "--force")
    assert r.exit_code == 2 and "'keep.txt'" not in out and "no gptoss hybrid_config.json" in out, out
    assert (dst / "keep.txt").read_text() == "precious"
    (dst / "keep.txt").unlink()
    r, out = run_convert(hf_bf16, dst, "--force")
    assert r.exit_code == 0, out
    r, out = run_convert(hf_bf16, dst, "--force")
    assert r.exit_code == 0, out
    assert (dst / "hybrid_config.json").exists()


def test_bad_options(hf_bf16, hybrid_from_bf16, tmp_path):
    r, out = run_convert(hf_bf16, tmp_path / "o", "--dtype", "float8")
    assert_clean_failure(r, out, "--dtype 'float8'")
    r, out = run_convert(hf_bf16, tmp_path / "o", "--experts", "mxfp4")
    assert_clean_failure(r, out, "--experts applies to HF and GGUF outputs only", dst=tmp_path / "o")
    r, out = run_convert(tmp_path / "nope", tmp_path / "o")
    assert_clean_failure(r, out, "nope")
