"""ShardedWriter's O_DIRECT path: the same bytes as through the page cache, and a fall-back where refused."""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from gptoss_cli.checkpoint.storage import direct_write
from gptoss_cli.checkpoint.storage.safetensors_io import ShardedWriter, TensorSpec
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


def _write(folder: Path, tensors: dict[str, torch.Tensor], direct_io: bool, max_shard_bytes: int = 60_000) -> list[Path]:
    folder.mkdir()
    plan = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    writer = ShardedWriter(folder, plan, max_shard_bytes=max_shard_bytes, direct_io=direct_io)
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


def _spy_staged(monkeypatch) -> dict[str, int]:
    """Counts the bytes DirectFile was given and those it copied into its staging buffers."""
    seen = {"given": 0, "staged": 0}
    real_write, real_stage = direct_write.DirectFile.write, direct_write.DirectFile._stage

    def write(self, data):
        seen["given"] += len(data) if isinstance(data, bytes) else data.numel()
        real_write(self, data)

    def stage(self, data):
        seen["staged"] += data.numel()
        real_stage(self, data)

    monkeypatch.setattr(direct_write.DirectFile, "write", write)
    monkeypatch.setattr(direct_write.DirectFile, "_stage", stage)
    return seen


def test_pieces_computed_into_the_writers_buffers_are_written_without_a_copy(tmp_path, monkeypatch):
    """Pieces from `ShardedWriter.empty` lie in memory as their bytes lie in the file (modulo 4096):
    only the bytes sharing a block with a neighbour are staged, and the shards hold the same bytes
    as those written through the page cache."""
    monkeypatch.setattr(direct_write, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(direct_write, "STAGING_BYTES", 8192)
    stayed_direct = _spy_direct(monkeypatch)
    seen = _spy_staged(monkeypatch)
    g = torch.Generator().manual_seed(1)
    # pieces start anywhere within a block; "e" (fp32) starts 2 bytes past a multiple of 4 in the
    # file (safetensors does not pad), where no fp32 tensor can lie in memory: it is staged whole
    tensors = {"a": torch.randn(4001, 37, generator=g).to(torch.bfloat16), "b": torch.randn(3, 5, generator=g).half(),
               "c": torch.randn(4099, 3, generator=g), "d": torch.randn(77, 129, generator=g).to(torch.bfloat16),
               "e": torch.randn(300, 20, generator=g)}
    plan = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    (tmp_path / "direct").mkdir()
    writer = ShardedWriter(tmp_path / "direct", plan, max_shard_bytes=320_000)
    bound = sum(len(writer._header_bytes(shard)) for shard in writer.shards)  # the headers are staged whole
    for k, v in tensors.items():
        for r0 in range(0, len(v), 1000):  # rows in pieces, as conversion streams them
            rows = v[r0 : r0 + 1000]
            out = writer.empty(k, r0, tuple(rows.shape), rows.dtype)
            writer.write(k, out.copy_(rows))
            nbytes = rows.numel() * rows.element_size()
            bound += nbytes if k == "e" else min(nbytes, 2 * direct_write.ALIGN)  # under a block at each end
    writer.close()
    if not any(stayed_direct):
        pytest.skip(f"{tmp_path}: this filesystem does not take O_DIRECT writes")
    assert all(stayed_direct) and len(stayed_direct) == len(writer.shards) == 2
    assert seen["staged"] <= bound < seen["given"] / 3, (seen, bound)
    direct = sorted((tmp_path / "direct").iterdir())
    cached = _write(tmp_path / "cached", tensors, direct_io=False, max_shard_bytes=320_000)
    assert [f.read_bytes() for f in direct] == [f.read_bytes() for f in cached]


@pytest.mark.parametrize("offset", [0, 1, 2, 4094, 4095, 4096, 12345])
def test_aligned_empty_places_the_first_byte_at_the_offset(offset):
    for dtype, shape in ((torch.uint8, (5000,)), (torch.bfloat16, (3, 1000)), (torch.float32, (0, 4))):
        t = direct_write.aligned_empty(shape, dtype, offset)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        if offset % t.element_size() == 0:  # a tensor's file offset is a multiple of its element size
            assert t.data_ptr() % direct_write.ALIGN == offset % direct_write.ALIGN


def test_convert_decodes_experts_into_the_writers_buffers_and_writes_what_plain_writes_do(hf_mxfp4, tmp_path, monkeypatch):
    """HF MXFP4 -> Hybrid with every shard written with O_DIRECT: the decoded experts go to the disk
    from the memory they were decoded into (only the bytes sharing a block with a neighbour are
    staged), and the folder is byte for byte the one a filesystem without O_DIRECT gets."""
    from gptoss_cli.checkpoint import convert as convert_module

    monkeypatch.setattr(direct_write, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(convert_module, "_made_by", lambda: {"tool": "gptoss", "created": "fixed"})
    stayed_direct = _spy_direct(monkeypatch)
    seen = _spy_staged(monkeypatch)
    convert_module.convert(str(hf_mxfp4), tmp_path / "direct")
    if not any(stayed_direct):
        pytest.skip(f"{tmp_path}: this filesystem does not take O_DIRECT writes")
    assert all(stayed_direct)
    experts = []
    for f in (tmp_path / "direct").glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            experts += [sf.get_slice(k) for k in sf.keys() if ".linear_fc" in k and ".weight" in k]
    expert_bytes = sum(2 * math.prod(s.get_shape()) for s in experts)  # bf16
    assert len(experts) > 8 and expert_bytes > seen["given"] / 2
    # the rest is staged, and under a block at each end of each expert
    assert seen["staged"] <= seen["given"] - expert_bytes + len(experts) * 2 * direct_write.ALIGN

    monkeypatch.setattr(direct_write, "open_direct", lambda path, flags: (_ for _ in ()).throw(
        OSError(errno.EINVAL, "Invalid argument")))  # tmpfs refuses O_DIRECT at open
    convert_module.convert(str(hf_mxfp4), tmp_path / "plain")
    assert not stayed_direct[-1]
    direct, plain = sorted((tmp_path / "direct").iterdir()), sorted((tmp_path / "plain").iterdir())
    assert [f.name for f in direct] == [f.name for f in plain]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(direct, plain))
