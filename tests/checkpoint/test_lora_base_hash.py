"""A LoRA base's fingerprint: the sha256 of its weight files, read in full once and then taken from a
cache keyed by each file's identity (name, size, mtime, ctime, inode); any change to a file hashes again."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from gptoss_cli.checkpoint.formats.training import record as training_record
from gptoss_cli.checkpoint.formats.training.record import base_fingerprint, base_hash_cache


def _reference_sha256(folder: Path) -> str:
    """The documented digest, computed here independently: each *.safetensors file in name order, its
    name, a NUL, then its bytes."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTOSS_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "base"
    folder.mkdir()
    for i, name in enumerate(("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")):
        (folder / name).write_bytes(bytes(range(256)) * (40 + i))
    (folder / "config.json").write_text("{}")  # not a weight file: not hashed
    return folder


def _no_full_read(monkeypatch):
    def refuse(files):
        raise AssertionError(f"read the files in full: {files}")
    monkeypatch.setattr(training_record, "hash_base_files", refuse)


def test_the_first_fingerprint_is_the_content_hash_and_later_ones_read_no_file(base, monkeypatch):
    expected = _reference_sha256(base)
    assert base_fingerprint(base) == {"path": str(base.resolve()), "sha256": expected}
    assert base_hash_cache(base.resolve()).is_file()
    assert not any(p.name.startswith(".") for p in base.iterdir())  # the base's folder is left alone
    _no_full_read(monkeypatch)
    assert base_fingerprint(base)["sha256"] == expected


def test_a_file_changed_in_place_with_size_and_mtime_restored_is_hashed_again(base):
    """What a size + mtime key would miss: same length, mtime put back (`touch -r`, `cp -p`, a tool that
    preserves times). Its ctime moved, so the files are read again and the new content's hash comes back."""
    first = base_fingerprint(base)["sha256"]
    f = base / "model-00002-of-00002.safetensors"
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    second = base_fingerprint(base)["sha256"]
    assert second != first and second == _reference_sha256(base)


def test_another_base_copied_over_with_its_times_is_hashed_again(base, tmp_path):
    first = base_fingerprint(base)["sha256"]
    other = tmp_path / "other"
    shutil.copytree(base, other)
    f = other / "model-00001-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[::-1])  # same size, other content, and our file's mtime
    mtime = (base / f.name).stat().st_mtime_ns
    os.utime(f, ns=(mtime, mtime))
    for g in other.glob("*.safetensors"):
        shutil.copy2(g, base / g.name)  # copy2 keeps the source's mtime
    assert (base / f.name).stat().st_mtime_ns == mtime
    second = base_fingerprint(base)["sha256"]
    assert second != first and second == _reference_sha256(other)


def test_a_broken_or_unwritable_cache_only_costs_a_full_hash(base, monkeypatch, tmp_path):
    expected = base_fingerprint(base)["sha256"]
    cache = base_hash_cache(base.resolve())
    cache.write_text('{"path": "' + str(base.resolve()) + '", "files": [], "sha256": "' + "0" * 64 + '"}')
    assert base_fingerprint(base)["sha256"] == expected  # another files list: not trusted
    cache.write_text("[[[")
    assert base_fingerprint(base)["sha256"] == expected
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    monkeypatch.setenv("GPTOSS_CACHE_DIR", str(blocker))  # cannot hold a folder
    assert base_fingerprint(base)["sha256"] == expected
