"""convert() leaves the process as it found it: torch's thread count is the caller's again after a
conversion, finished or failed (it runs with one torch thread per worker in between), and planning
it does not import torch._dynamo."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from gptoss_cli.checkpoint.convert import convert
from gptoss_cli.errors import CheckpointError


@pytest.fixture
def caller_threads():
    before = torch.get_num_threads()
    theirs = 3 if before != 3 else 2  # a setting convert's own (1) is not
    torch.set_num_threads(theirs)
    yield theirs
    torch.set_num_threads(before)


def test_a_finished_conversion_gives_back_torchs_thread_count(hf_bf16, tmp_path, caller_threads):
    convert(str(hf_bf16), tmp_path / "hybrid", dtype="float32")
    assert torch.get_num_threads() == caller_threads
    convert(str(tmp_path / "hybrid"), tmp_path / "hf")
    assert torch.get_num_threads() == caller_threads


def test_a_failed_conversion_gives_back_torchs_thread_count(hf_copy, tmp_path, caller_threads):
    # a NaN found by a worker thread mid-conversion: the error leaves through the pipeline
    shard = sorted(hf_copy.glob("*.safetensors"))[-1]
    tensors = load_file(str(shard))
    name = next(n for n, t in tensors.items() if t.is_floating_point() and t.dim() == 2)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="non-finite"):
        convert(str(hf_copy), tmp_path / "o")
    assert torch.get_num_threads() == caller_threads
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("to", ["hybrid", "megatron"])
def test_planning_a_conversion_does_not_import_torch_dynamo(to, hf_mxfp4, tmp_path):
    """The plan derives every output shape by running the mapping table on meta tensors; torch's
    first cat of meta tensors imports torch._dynamo, 2-10 s on the 2-core reference machine, paid
    inside every `gptoss convert`. The table's transforms fill tensors by slices instead."""
    import subprocess
    import sys

    code = ("import sys; from gptoss_cli.checkpoint.convert import convert; "
            f"convert({str(hf_mxfp4)!r}, {str(tmp_path / 'out')!r}, to={to!r}); "
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
