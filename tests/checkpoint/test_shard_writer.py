"""ShardedWriter's O_DIRECT path: the same bytes as through the page cache, and a fall-back where refused."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from gptoss_cli.checkpoint import direct_write
from gptoss_cli.checkpoint.safetensors_io import ShardedWriter, TensorSpec
from gptoss_cli.errors import CheckpointError


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # sizes that are not multiples of the 4096-byte direct-write block, one empty, several dtypes
    return {
        "a": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "b": torch.randint(0, 256, (70001,), dtype=torch.uint8, generator=g),
        "c": torch.randn(0, 5, generator=g),
        "d": torch.randn(1025, 3, generator=g),
        "e": torch.randint(0, 256, (4096, 2), dtype=torch.uint8, generator=g),
    }


def _write(folder: Path, tensors: dict[str, torch.Tensor], direct_io: bool) -> list[Path]:
    folder.mkdir()
    plan = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    writer = ShardedWriter(folder, plan, max_shard_bytes=60_000, direct_io=direct_io)
    for k, v in tensors.items():
        for rows in (v[:2], v[2:]):  # each tensor in two pieces, as conversion streams them
            if len(rows) or not len(v):
                writer.write(k, rows)
                if not len(v):
                    break
    writer.close()
    return sorted(folder.iterdir())


def _spy_direct(monkeypatch) -> list[bool]:
    """Records, for each shard closed, whether it was still being written with O_DIRECT."""
    stayed_direct: list[bool] = []
    real_close = direct_write.DirectFile.close

    def close(self):
        stayed_direct.append(self._direct)
        real_close(self)

    monkeypatch.setattr(direct_write.DirectFile, "close", close)
    return stayed_direct


@pytest.mark.parametrize("staging", [8192, 1000])
def test_direct_shards_hold_the_same_bytes_as_page_cache_shards(staging, tmp_path, monkeypatch):
    # 8192: several full staging flushes through both buffers, then a padded, truncated tail.
    # 1000: Linux refuses O_DIRECT writes whose length is not a multiple of the logical block size
    # (EINVAL), so a file that fills the staging buffer falls back to ordinary writes
    monkeypatch.setattr(direct_write, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(direct_write, "STAGING_BYTES", staging)
    stayed_direct = _spy_direct(monkeypatch)
    tensors = _tensors()
    direct_files = _write(tmp_path / "direct", tensors, direct_io=True)
    if staging % 4096 == 0:
        if not any(stayed_direct):
            pytest.skip(f"{tmp_path}: this filesystem does not take O_DIRECT writes")
        assert all(stayed_direct)
    elif all(stayed_direct):
        pytest.skip(f"{tmp_path}: this filesystem takes unaligned O_DIRECT writes; nothing falls back")
    cached_files = _write(tmp_path / "cached", tensors, direct_io=False)
    assert [f.name for f in direct_files] == [f.name for f in cached_files]
    assert len(direct_files) > 2  # several shards: a file switch with a pending tail
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(direct_files, cached_files))
    for f in direct_files[:-1]:  # the last one is the index
        with safe_open(str(f), "pt") as sf:
            assert all(torch.equal(sf.get_tensor(k), tensors[k]) for k in sf.keys())


def test_a_filesystem_refusing_o_direct_at_open_gets_ordinary_writes(tmp_path, monkeypatch):
    def refuse(path, flags):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(direct_write, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(direct_write, "open_direct", refuse)
    stayed_direct = _spy_direct(monkeypatch)
    tensors = _tensors()
    files = _write(tmp_path / "o", tensors, direct_io=True)
    assert stayed_direct and not any(stayed_direct)
    assert [f.read_bytes() for f in files] == [f.read_bytes() for f in _write(tmp_path / "ref", tensors, False)]


def test_disk_full_on_the_io_thread_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_write, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(direct_write, "STAGING_BYTES", 8192)
    # /dev/full takes the open and fails every write with ENOSPC, as a full disk does
    monkeypatch.setattr(direct_write, "open_direct", lambda path, flags: os.open("/dev/full", os.O_WRONLY))
    tensors = _tensors()
    (tmp_path / "o").mkdir()
    writer = ShardedWriter(tmp_path / "o", [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()],
                           max_shard_bytes=60_000)
    with pytest.raises(CheckpointError, match="disk full"):
        try:
            for k, v in tensors.items():
                writer.write(k, v)
            writer.close()
        finally:
            writer.abort()
