"""Path safety: DST never equals, contains or lies inside SRC; --force replaces only a previous gptoss output."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from tests.faults.conftest import assert_one_line, digest, gptoss
from tests.support.cli import exit_and_output as invoke


def test_force_onto_the_folder_holding_the_source_destroys_nothing(tiny_hf, tmp_path):
    models = tmp_path / "models"
    src = models / "src"
    shutil.copytree(tiny_hf, src)
    (models / "notes.txt").write_text("unrelated and precious")
    before = digest(models)
    proc = gptoss("convert", src, models, "--force", "--quiet", cwd=tmp_path)
    assert_one_line(proc, 2, f"DST {models} contains the source {src}")
    assert digest(models) == before


@pytest.mark.parametrize("where", ["same", "symlink", "inside"])
def test_dst_may_not_be_or_lie_inside_the_source(tiny_hf, tmp_path, where):
    src = tmp_path / "src"
    shutil.copytree(tiny_hf, src)
    dst = {"same": src, "symlink": tmp_path / "link", "inside": src / "out"}[where]
    if where == "symlink":
        dst.symlink_to(src)
    before = digest(src)
    code, out = invoke("convert", src, dst, "--force", "--quiet")
    assert code == 2 and ("is the source folder" in out or "lies inside the source" in out), out
    assert digest(src) == before and not (src / "out").exists()


def test_force_replaces_only_a_previous_output_of_the_same_kind(tiny_hf, tiny_hybrid, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.bin").write_bytes(b"\x00" * 10)
    hybrid_with_extra = tmp_path / "hybrid"
    shutil.copytree(tiny_hybrid, hybrid_with_extra)
    (hybrid_with_extra / "README.md").write_text("mine")
    kept = {p: digest(p) for p in (foreign, hybrid_with_extra, tiny_hybrid)}

    code, out = invoke("convert", tiny_hf, foreign, "--force", "--quiet")
    assert code == 2 and "no gptoss hybrid_config.json" in out, out
    code, out = invoke("convert", tiny_hf, hybrid_with_extra, "--force", "--quiet")
    assert code == 2 and "'README.md', which gptoss does not write" in out, out
    # An HF conversion may not replace a Hybrid output (nor make-tiny, which writes HF).
    code, out = invoke("convert", tiny_hybrid, tiny_hybrid.parent / "hf-out", "--quiet")
    assert code == 0, out
    code, out = invoke("make-tiny", tiny_hybrid, "--force")
    assert code == 2 and "previous gptoss Hugging Face output" in out, out
    assert {p: digest(p) for p in kept} == kept

    previous = tmp_path / "previous"
    shutil.copytree(tiny_hybrid, previous)
    code, out = invoke("convert", tiny_hf, previous, "--force", "--quiet")
    assert code == 0, out
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = invoke("make-tiny", empty, "--force")
    assert code == 0, out


# From issue 10: a failed --force conversion keeps the old DST, and the space check comes first.
def test_a_failing_forced_conversion_keeps_the_old_dst_intact(tiny_hf, tiny_hybrid, tmp_path):
    dst = tmp_path / "dst"
    shutil.copytree(tiny_hybrid, dst)
    before = digest(dst)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_hf, broken)
    shard = next(broken.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated mid-tensor
    code, out = invoke("convert", broken, dst, "--force", "--quiet")
    assert code == 2 and str(shard) in out, out
    assert digest(dst) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_free_space_is_checked_before_anything_is_written(tiny_hf, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    parent = tmp_path / "space"
    parent.mkdir()
    code, out = invoke("convert", tiny_hf, parent / "deeper" / "dst", "--quiet")
    assert code == 2 and "not enough disk space" in out, out
    assert list(parent.iterdir()) == []  # not even DST's own parent folder was created


@pytest.mark.parametrize("suffix", [".json", ".bin"])
def test_prepare_data_out_naming_one_of_its_inputs_is_refused_and_the_input_kept(tmp_path, suffix):
    pytest.importorskip("tokenizers")
    from tests.faults.test_tokens import write_tokenizer

    tok = write_tokenizer(tmp_path / "tok")
    data = tmp_path / "data"
    data.mkdir()
    source = data / f"train{suffix}"
    source.write_bytes(b'{"text": "the quick brown fox"}\n' if suffix == ".json" else b"the lazy dog\n")
    other = data / "more.txt"
    other.write_text("jumps over\n")
    before = digest(data)
    proc = gptoss("prepare-data", other, source, "--tokenizer", tok, "--out", data / "train", "--eos-id", "1",
                  cwd=tmp_path)
    assert_one_line(proc, 2, f"--out {data / 'train'} would overwrite {source}, which this command reads")
    assert digest(data) == before
