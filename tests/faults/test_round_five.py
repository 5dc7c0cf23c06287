"""Issue 54's last tracebacks, each as the class it belongs to:
- a safetensors header claiming a terabyte on the side no shape check covers (parity-check's Hybrid) is refused
  before allocating, naming the file and tensor; an allocator failure anywhere is one line naming what was read;
- a training checkpoint whose DCP metadata lacks master copies: `convert --weights master` is one line, exit 2,
  nothing at OUT;
- a run record number out of range (a LoRA alpha of NaN) is refused before it is used or written.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gptoss_cli import allocation
from gptoss_cli.cli import app
from gptoss_cli.errors import CheckpointError, OutOfMemory, UsageError
from tests.faults.conftest import TRAIN_FAST, assert_one_line
from tests.faults.test_huge_claims import claim_a_terabyte

runner = CliRunner()


def test_parity_check_refuses_a_hybrid_tensor_claiming_a_terabyte_naming_it(tiny_hf, tiny_hybrid, tmp_path):
    pytest.importorskip("transformers")
    hybrid = tmp_path / "hybrid"
    shutil.copytree(tiny_hybrid, hybrid)
    shard = claim_a_terabyte(hybrid, "decoder.layers.0.self_attention.linear_qkv.weight")
    # in this process: the claim is above any test machine's memory and swap, so it is refused unallocated
    result = runner.invoke(app, ["parity-check", str(tiny_hf), str(hybrid)])
    assert "allocate memory" not in result.output
    assert_one_line((result.exit_code, result.output), 2, str(shard), "'decoder.layers.0.self_attention.linear_qkv.weight'",
                    "claims 1099511627776 bytes", "sparse")


def test_a_claim_above_the_machine_is_refused_before_allocating(tmp_path, monkeypatch):
    dense = tmp_path / "dense"
    dense.write_bytes(b"\1" * 4096)
    monkeypatch.setattr(allocation, "memory_ceiling_bytes", lambda: 1024)
    made = []
    with pytest.raises(OutOfMemory, match=r"dense: tensor 'w': needs 2048 bytes, more than this machine"):
        allocation.claimed(f"{dense}: tensor 'w'", 2048, lambda: made.append(1), dense)
    sparse = tmp_path / "sparse"
    sparse.write_bytes(b"")
    sparse.open("r+b").truncate(1 << 30)
    with pytest.raises(UsageError, match=r"claims 1073741824 bytes, but the file holds only 0 bytes"):
        allocation.claimed(f"{sparse}: tensor 'w'", 1 << 30, lambda: made.append(1), sparse)
    assert made == []


@pytest.mark.parametrize("failure", [RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: "
                                                  "can't allocate memory: you tried to allocate 1099511627776 bytes"),
                                     MemoryError()])
def test_an_allocator_failure_is_one_line_naming_what_was_read(failure, monkeypatch, tmp_path):
    def fail():
        raise failure

    with pytest.raises(OutOfMemory, match=r"x.safetensors: tensor 'w': out of memory"):
        allocation.claimed("x.safetensors: tensor 'w'", 8, fail)
    # one that escaped every reader: the CLI's line, exit 1, no traceback
    from gptoss_cli.cli.app import handle_errors
    import typer

    with pytest.raises(typer.Exit) as exit_:
        handle_errors(fail)()
    assert exit_.value.exit_code == 1


@pytest.fixture(scope="module")
def training_ckpt(tmp_path_factory) -> Path:
    """checkpoint.dir of a 1-step, one-process run (fp32 parameters, master copies in the optimizer)."""
    work = tmp_path_factory.mktemp("train")
    result = runner.invoke(app, ["train", "--recipe", "tiny_cpu_ep2", f"checkpoint.dir={work / 'ckpt'}",
                                 f"logging.run_dir={work / 'run'}", *TRAIN_FAST, "--nproc-per-node", "1",
                                 "parallelism.expert_model_parallel_size=1", "training.train_iters=1", "-q"])
    assert result.exit_code == 0, result.output
    return work / "ckpt"


def test_convert_master_weights_missing_from_the_metadata_is_one_line_and_nothing_at_out(training_ckpt, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(training_ckpt, src)
    meta_path = src / "iter_0000001" / ".metadata"
    meta = pickle.loads(meta_path.read_bytes())
    for key in [k for k in meta.state_dict_metadata if k.endswith(".master") and ".layers.1." in k]:
        del meta.state_dict_metadata[key]
    meta_path.write_bytes(pickle.dumps(meta))
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--weights", "master", "--dtype", "float32"])
    assert_one_line((result.exit_code, result.output), 2, "its DCP metadata has no tensor", ".master", "--weights master")
    assert not (tmp_path / "out").exists()


def _edit_run(folder: Path, edit) -> None:
    path = folder / "iter_0000001" / "train_state.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state, allow_nan=True))


LORA = {"rank": 2, "alpha": 4.0, "dropout": 0.0, "target_modules": ["linear_qkv"],
        "base": {"path": "/nowhere", "sha256": "0" * 64}}


@pytest.mark.parametrize("field, value, words", [
    ("alpha", float("nan"), "run.lora.alpha is not a finite number"),
    ("alpha", float("inf"), "run.lora.alpha is not a finite number"),
    ("alpha", -2.0, "run.lora.alpha is -2.0"), ("rank", 2**40, "run.lora.rank is 1099511627776"),
    ("rank", 2.5, "run.lora.rank is 2.5"), ("dropout", 1.5, "run.lora.dropout is 1.5"),
    ("target_modules", ["q_proj"], "run.lora is not a LoRA record"),
])
def test_a_run_record_number_out_of_range_is_refused_before_export(training_ckpt, tmp_path, field, value, words):
    from gptoss_cli.checkpoint.formats.training.record import read_training_run

    src = tmp_path / "ckpt"
    shutil.copytree(training_ckpt, src)
    _edit_run(src, lambda s: s["run"].__setitem__("lora", {**LORA, field: value}))
    with pytest.raises(CheckpointError, match=words.replace(".", r"\.").replace("[", r"\[")):
        read_training_run(src / "iter_0000001")
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "peft"), "--to", "peft"])
    assert_one_line((result.exit_code, result.output), 2, words)
    assert not (tmp_path / "peft").exists()


def test_no_field_of_a_train_state_may_be_nan(training_ckpt, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(training_ckpt, src)
    _edit_run(src, lambda s: s["run"]["recipe"].setdefault("training", {}).__setitem__("lr", float("nan")))
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out")])
    assert_one_line((result.exit_code, result.output), 2, "run.recipe.training.lr is not a finite number")
