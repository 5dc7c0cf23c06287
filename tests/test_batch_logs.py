"""Output for batch jobs: off a terminal (sbatch, CI, `| tee`) nothing wraps at 80 columns.

CliRunner's stdout is not a terminal, as a batch scheduler's log is not: a training step is one line,
and validate-config's fix commands stay whole (rich's default width off a terminal is 80 columns,
which split both)."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from gptoss_cli.cli import app


def test_validate_configs_fix_commands_are_never_broken_mid_word(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    result = CliRunner().invoke(app, ["validate-config", "gb200_fp8mx"])
    assert result.exit_code == 1
    fixes = [line for line in result.output.splitlines() if "fix:" in line]
    assert fixes and any("cuda_graphs.cuda_graph_impl=none cuda_graphs.paged_stash=false" in line for line in fixes)
    assert any("overlap.overlap_moe_expert_parallel_comm=false overlap.delay_wgrad_compute=false" in line
               for line in fixes), result.output


def test_training_prints_one_plain_line_per_step(tmp_path, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    result = CliRunner().invoke(app, [
        "train", "--recipe", "tiny_cpu_ep2", "--nproc-per-node", "1", "parallelism.expert_model_parallel_size=1",
        "training.train_iters=2", "training.seq_length=16", "training.global_batch_size=4",
        "precision.params_dtype=fp32", f"logging.run_dir={tmp_path / 'run'}", "checkpoint.dir=null",
        "checkpoint.save_interval=null"])
    assert result.exit_code == 0, result.output
    steps = [line for line in result.output.splitlines() if re.match(r"step \d+:", line)]
    assert len(steps) == 2 and all(re.search(r"loss \S+ .*ms/step .*TFLOP/s/GPU", line) for line in steps), steps
