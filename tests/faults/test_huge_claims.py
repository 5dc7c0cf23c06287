"""A safetensors header may claim a tensor of any size (a sparse file even holds the bytes): every command
compares the claimed shapes with the config before it reads, so nothing tries to allocate the claim."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.faults.conftest import assert_one_line, child_env, gptoss_cmd

TB = 1 << 40
MEMORY_LIMIT = 8 << 30  # the child may not map more than this: an attempt to allocate the claim fails loudly


def claim_a_terabyte(folder: Path, name: str) -> Path:
    """Rewrite `name` in the folder's shard as a 1 TB tensor stored at its end, the file grown sparsely to hold it."""
    shard = sorted(folder.glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    cols = header[name]["shape"][-1]
    header[name] = {"dtype": header[name]["dtype"], "shape": [TB // 2 // cols, cols], "data_offsets": [end, end + TB]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(len(text).to_bytes(8, "little") + text + data)
    try:
        os.truncate(shard, 8 + len(text) + end + TB)
    except OSError as exc:
        pytest.skip(f"this file system cannot hold a sparse 1 TB file: {exc}")
    return shard


def run_limited(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    return subprocess.run(gptoss_cmd(*args), cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=limit)


def test_parity_check_refuses_an_hf_tensor_claiming_a_terabyte_before_reading_it(tiny_hf, tiny_hybrid, tmp_path):
    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf, hf)
    shard = claim_a_terabyte(hf, "model.embed_tokens.weight")
    proc = run_limited("parity-check", hf, tiny_hybrid, cwd=tmp_path)
    assert "allocate" not in proc.stderr, proc.stderr[-2000:]
    # torchao, imported with transformers, warns about kernels this machine lacks: not ours
    ours = "\n".join(line for line in proc.stderr.splitlines()
                      if not line.startswith("Failed to load") and "_pytree.py" not in line)
    assert_one_line((proc.returncode, ours), 2, str(shard), "'model.embed_tokens.weight' has shape [8589934592, 64]", "expected [1003, 64]")


def test_convert_refuses_a_tensor_claiming_a_terabyte_before_reading_it(tiny_hf, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf, hf)
    shard = claim_a_terabyte(hf, "model.embed_tokens.weight")
    proc = run_limited("convert", hf, tmp_path / "dst", "--quiet", cwd=tmp_path)
    assert_one_line(proc, 2, str(shard), "has shape [8589934592, 64]")
    assert not (tmp_path / "dst").exists()
