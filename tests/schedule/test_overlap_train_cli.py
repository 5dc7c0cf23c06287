"""Smoke: `gptoss train` runs the Hybrid model's combined-1F1B path for several iterations (EP=2, 2 processes)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

SMALL = ["training.train_iters=4", "training.seq_length=16", "training.global_batch_size=8",
         "checkpoint.dir=null", "checkpoint.save_interval=null"]


def _train(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "gptoss_cli", "train", "--recipe", "tiny_cpu_ep2_overlap", *SMALL, *overrides,
         f"logging.run_dir={tmp_path / 'run'}", "--json", str(tmp_path / "result.json")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )


def test_tiny_ep2_overlap_recipe_trains_several_iterations(tmp_path):
    # The recipe is the one the rules used to reject (overlap.schedule_plan): overlap + delayed wgrad, bf16.
    proc = _train(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["steps"], result["world_size"], result["ep_size"]) == (4, 2, 2)
    assert all(math.isfinite(x) for x in result["losses"] + result["grad_norms"])
    assert result["losses"][-1] < result["losses"][0]  # the mock data is learnable
    recipe = json.loads((tmp_path / "run" / "recipe.json").read_text())
    assert recipe["overlap"]["overlap_moe_expert_parallel_comm"] and recipe["overlap"]["delay_wgrad_compute"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["rank"]) for r in rows) == [(s, r) for s in (1, 2, 3, 4) for r in (0, 1)]
