"""`gptoss train` end to end: shared-rule preflight, the elastic launcher on 2 CPU processes, worker failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from gptoss_cli.cli import app
from gptoss_cli.model.config import PRESETS
from gptoss_cli.recipe.estimate.flops import model_flops_per_token

FAST = ["training.seq_length=16", "training.global_batch_size=4", "precision.params_dtype=fp32"]


def _gptoss(args: list[str], cwd, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "gptoss_cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_train_tiny_ep2_on_two_processes_writes_metrics_and_checkpoint(tmp_path):
    proc = _gptoss(["train", "--recipe", "tiny_cpu_ep2", "training.train_iters=3", "checkpoint.save_interval=2",
                    f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.run_dir={tmp_path / 'run'}", *FAST,
                    "--json", str(tmp_path / "result.json")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 3: loss" in proc.stdout  # rank 0's progress, once per step (not a terminal here)
    assert proc.stdout.count("step 3: loss") == 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["rank"]) for r in rows) == [(s, r) for s in (1, 2, 3) for r in (0, 1)]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "rank_loss"} <= rows[0].keys()
    # Model FLOPs (recipe/estimate/flops.py) of the tiny preset at 16 tokens; TFLOP/s per GPU is them x the
    # step's 4 x 16 tokens / step time / 2 processes; no MFU on a CPU (no peak).
    flops = model_flops_per_token(PRESETS["tiny"], 16)
    for r in rows:
        assert r["model_flops_per_token"] == flops and r["mfu"] is None
        assert r["tflops_per_gpu"] == pytest.approx(flops * 64 / r["step_time_s"] / 2 / 1e12, rel=1e-9)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "iter_0000003"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2 and result["ep_size"] == 2 and result["steps"] == 3
    assert result["model_flops_per_token"] == flops and result["tflops_per_gpu"] > 0 and result["mfu"] is None
    assert "TFLOP/s/GPU" in proc.stdout


def test_failing_worker_ends_the_job_with_its_error_in_one_line(tmp_path):
    # A token file that exists (so the preflight passes) but is shorter than one sample.
    (tmp_path / "short.json").write_text(json.dumps(
        {"format": "gptoss-tokens", "version": 1, "dtype": "uint16", "num_tokens": 4, "vocab_size": 1003}))
    (tmp_path / "short.bin").write_bytes(bytes(8))
    proc = _gptoss(["train", "--recipe", "tiny_cpu_ep2", "data.kind=tokens", f"data.path={tmp_path / 'short'}",
                    "checkpoint.dir=null", "checkpoint.save_interval=null", f"logging.run_dir={tmp_path / 'run'}",
                    *FAST], tmp_path, timeout=120)
    assert proc.returncode == 2  # the worker's ConfigError keeps its exit code
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "worker rank" in errors[0] and "fewer than one sample" in errors[0]
    assert "Traceback" not in proc.stderr


def test_rules_reject_the_recipe_before_any_process_starts(tmp_path):
    # Overlap on a pattern the schedule plan cannot split (a pipeline split) fails the capability rule.
    result = CliRunner().invoke(app, ["train", "--recipe", "tiny_cpu_ep2_overlap",
                                      "model.hybrid_layer_pattern=*E*E|*E", f"logging.run_dir={tmp_path}"])
    assert result.exit_code == 1
    assert "overlap.schedule_plan" in result.output
    assert not (tmp_path / "metrics.jsonl").exists()


def test_world_size_that_ep_does_not_divide_is_rejected(tmp_path):
    result = CliRunner().invoke(app, ["train", "--recipe", "tiny_cpu_ep2", "--nproc-per-node", "1",
                                      f"logging.run_dir={tmp_path}"])
    assert result.exit_code == 1
    assert "parallel.expert_world_divisible" in result.output


def test_inside_torchrun_each_process_trains_directly(tmp_path):
    from tests.train.dist_helpers import run_distributed
    from tests.train.workers import torchrun_style_worker

    overrides = ["training.train_iters=2", "checkpoint.dir=null", "checkpoint.save_interval=null",
                 f"logging.run_dir={tmp_path / 'run'}", "training.warmup_iters=1", *FAST]
    ranks = run_distributed(torchrun_style_worker, 2, tmp_path / "out", overrides)
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == 2


def _killed_worker(exitcode: int):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(local_rank=1, pid=12345, exitcode=exitcode, error_file="/nonexistent/error.json")


def test_a_worker_the_oom_killer_ended_is_reported_as_out_of_memory(tmp_path, monkeypatch):
    """The elastic agent sees a SIGKILLed worker as exit code -9; the kernel's own count of OOM kills
    (/proc/vmstat `oom_kill`) going up during the run is what says it was out of memory."""
    from gptoss_cli.errors import TrainingError
    from gptoss_cli.run import launch

    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 1\noom_kill 3\npgfault 9\n")
    assert launch.oom_kills(str(vmstat)) == 3
    assert launch.oom_kills(str(tmp_path / "missing")) is None
    counts = iter([5])
    monkeypatch.setattr(launch, "oom_kills", lambda vmstat="": next(counts))
    err = launch._worker_error(1, _killed_worker(-9), oom_before=4)
    assert isinstance(err, TrainingError) and err.exit_code == 1
    assert "worker rank 1 ran out of memory" in str(err) and "out-of-memory killer" in str(err)
    # SIGKILL without an OOM kill (another process sent it): the signal, not a guess
    monkeypatch.setattr(launch, "oom_kills", lambda vmstat="": 4)
    err = launch._worker_error(1, _killed_worker(-9), oom_before=4)
    assert "out of memory" not in str(err) and "SIGKILL" in str(err)


def test_a_missing_data_path_is_bad_input_exit_2_before_any_process(tmp_path):
    """docs/commands.md: a missing file is bad input (exit 2), one line naming the field and the path."""
    missing = tmp_path / "nowhere" / "corpus"
    result = CliRunner().invoke(app, ["train", "--recipe", "tiny_cpu_ep2", "data.kind=tokens", f"data.path={missing}",
                                      f"logging.run_dir={tmp_path / 'run'}", "checkpoint.dir=null",
                                      "checkpoint.save_interval=null"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and str(missing) in lines[0], result.output
    assert not (tmp_path / "run").exists()


def test_pretrained_weights_of_another_architecture_are_refused_before_any_process(tmp_path):
    from gptoss_cli.checkpoint.make_tiny import make_tiny

    make_tiny(tmp_path / "hf")  # the tiny preset: 3 blocks
    result = CliRunner().invoke(app, ["train", "--recipe", "tiny_cpu_ep2", f"checkpoint.pretrained={tmp_path / 'hf'}",
                                      "model.architecture={num_hidden_layers: 2}", "lora.rank=8",
                                      f"logging.run_dir={tmp_path / 'run'}", "checkpoint.dir=null",
                                      "checkpoint.save_interval=null"])
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "checkpoint.settings" in text, result.output
    assert "has num_hidden_layers=3, the recipe's model has num_hidden_layers=2" in text
    assert not (tmp_path / "run").exists()
