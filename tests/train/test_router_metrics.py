"""Router telemetry and logging backends of a real `gptoss train` run (2 CPU processes, EP=2, weights
from a transformers tiny GPT-OSS): metrics.jsonl's expert load against transformers' router on the
same batch, TensorBoard's own event reader and W&B's offline run file against metrics.jsonl."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gptoss_cli.cli import app
from gptoss_cli.train.loggers import TENSORBOARD_DIR, WANDB_DIR, scalar_tags

pytest.importorskip("transformers")

STEPS = 2
SEQ, GBS = 16, 4
AUX, Z = 0.01, 1e-3


def _gptoss(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", WANDB_SILENT="true")
    return subprocess.run([sys.executable, "-m", "gptoss_cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 2-step run with aux and z-loss, TensorBoard and W&B (offline when installed)."""
    from tests.model.tiny_checkpoints import write_converted_pair

    root = tmp_path_factory.mktemp("router_run")
    hf, hybrid = write_converted_pair(root)
    args = ["train", "--recipe", "tiny_cpu_ep2", f"training.train_iters={STEPS}", f"training.seq_length={SEQ}",
            f"training.global_batch_size={GBS}", "training.micro_batch_size=1", "precision.params_dtype=fp32",
            f"checkpoint.pretrained={hybrid}", "checkpoint.dir=null", "checkpoint.save_interval=null", f"logging.run_dir={root / 'run'}",
            f"moe.aux_loss_coeff={AUX}", f"moe.z_loss_coeff={Z}", "logging.tensorboard=true"]
    wandb = _installed("wandb")
    if wandb:
        args += ["logging.wandb_project=gptoss-test", "logging.wandb_mode=offline"]
    proc = _gptoss(args, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"root": root, "hf": hf, "run_dir": root / "run", "rows": rows, "wandb": wandb}


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _rank0(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in rows if r["rank"] == 0}


def test_expert_load_equals_transformers_router_counts_on_the_step_batch(run):
    """Step 1 routes the step's whole global batch (both ranks, every microbatch) with the
    initial weights: the counts of transformers' router on those tokens, per MoE layer."""
    from gptoss_cli.model.config import preset
    from gptoss_cli.train.data import build_source
    from tests.model.tiny_checkpoints import load_hf_reference

    tiny = preset("tiny")
    recipe = json.loads((run["run_dir"] / "recipe.json").read_text())
    source = build_source("mock", path=None, seq_length=SEQ, seed=recipe["training"]["seed"], vocab_size=tiny.vocab_size)
    tokens = torch.stack([source.sample(i)[:-1] for i in range(GBS)])  # the inputs of step 1's samples
    hf = load_hf_reference(run["hf"])
    indices: list[torch.Tensor] = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, i, o: indices.append(o[2]))
             for layer in hf.model.layers]
    with torch.no_grad():
        hf(tokens)
    for h in hooks:
        h.remove()
    step1 = _rank0(run["rows"])[1]
    moe_layers = [str(j) for j in range(1, 2 * tiny.num_hidden_layers, 2)]  # the '*E' pattern: E at 1, 3, 5
    assert list(step1["expert_load"]) == moe_layers
    for layer, idx in zip(moe_layers, indices):
        assert step1["expert_load"][layer] == torch.bincount(idx.reshape(-1), minlength=tiny.num_local_experts).tolist()


def test_router_fields_on_every_step_are_consistent(run):
    from gptoss_cli.model.config import preset

    tiny = preset("tiny")
    rows = run["rows"]
    assert sorted((r["step"], r["rank"]) for r in rows) == [(s, r) for s in range(1, STEPS + 1) for r in (0, 1)]
    for r in rows:
        assert r["aux_loss"] > 0 and r["z_loss"] > 0
        if r["rank"] != 0:  # the global telemetry is written once per step, on rank 0's line
            assert "expert_load" not in r
            continue
        for layer, load in r["expert_load"].items():
            assert sum(load) == GBS * SEQ * tiny.num_experts_per_tok
            mean = sum(load) / len(load)
            cv = math.sqrt(sum((c - mean) ** 2 for c in load) / len(load)) / mean
            assert r["router_cv"][layer] == pytest.approx(cv, rel=1e-12)
            assert 0 < r["router_entropy"][layer] <= math.log(tiny.num_local_experts)


def test_tensorboard_scalars_read_back_equal_metrics_jsonl(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run["run_dir"] / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    got = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    expected = {(tag, r["step"]): v for r in run["rows"] for tag, v in scalar_tags(r).items()}
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=2**-23, abs=1e-30), key  # TensorBoard stores float32
    # spot checks of the tag scheme, against the JSON itself
    step1 = _rank0(run["rows"])[1]
    assert got[("train/loss", 1)] == pytest.approx(step1["loss"], rel=2**-23)
    assert got[("train/expert_load/3/2", 1)] == step1["expert_load"]["3"][2]
    rank1 = next(r for r in run["rows"] if r["rank"] == 1 and r["step"] == 2)
    assert got[("rank1/loss", 2)] == pytest.approx(rank1["rank_loss"], rel=2**-23)


def test_wandb_offline_run_holds_the_scalars(run):
    if not run["wandb"]:
        pytest.skip("wandb is not installed")
    from wandb.proto import wandb_internal_pb2

    files = list((run["run_dir"] / WANDB_DIR).rglob("*.wandb"))
    assert len(files) == 1, files
    history = []
    for payload in _wandb_records(files[0].read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    by_step = {h["_step"]: h for h in history}
    assert sorted(by_step) == list(range(1, STEPS + 1))
    for r in run["rows"]:
        for tag, value in scalar_tags(r).items():
            assert by_step[r["step"]][tag] == pytest.approx(value, rel=1e-12), tag


def _wandb_records(data: bytes) -> list[bytes]:
    """The protobuf records of a W&B run file: a 7-byte header (":W&B", magic, version), then
    LevelDB log blocks of 32 KiB holding records as (crc32c, length, type) + payload, a record
    split over blocks as FIRST, MIDDLE..., LAST; block tails shorter than a header are padding."""
    block, header = 32768, 7
    assert data[:4] == b":W&B"
    pos, out, parts = header, [], b""
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunk = data[pos + header:pos + header + length]
        pos += header + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            parts = chunk
        elif kind == 3:
            parts += chunk
        elif kind == 4:
            out.append(parts + chunk)
    return out


@pytest.mark.parametrize("field,module,package", [("logging.tensorboard=true", "torch.utils.tensorboard", "tensorboard"),
                                                  ("logging.wandb_project=p", "wandb", "wandb")])
def test_missing_backend_package_is_one_line_before_launch(tmp_path, monkeypatch, field, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    result = CliRunner().invoke(app, ["train", "--recipe", "tiny_cpu_ep2", field, "checkpoint.dir=null", "checkpoint.save_interval=null",
                                      f"logging.run_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and field.split("=")[0] in lines[0], result.output
    assert "pip install 'gptoss-cli[" in lines[0]
    assert f"needs the `{package}` package" in lines[0]  # the missing package, not torch
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
