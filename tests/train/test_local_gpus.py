"""More ranks on a node than visible GPUs is refused before any rank starts (parallel/state.py, `check_local_gpus`).

Before, `pick_device` wrapped the extra ranks onto GPUs already taken (`local_rank % device_count`)
and NCCL failed later, mid-setup. The GPU count is faked here (no GPU on the test machines); the
launcher must refuse in one line, exit 2, before starting a worker or taking a lock.
"""

from __future__ import annotations

import pytest
import torch

from gptoss_cli.errors import ConfigError
from gptoss_cli.parallel import state
from gptoss_cli.recipe.load import load_recipe
from gptoss_cli.run import launch


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail(f"set_device({i}) on a shared GPU"))


def test_more_local_ranks_than_gpus_is_one_line_exit_2(two_gpus):
    state.check_local_gpus(2, "auto")
    state.check_local_gpus(3, "cpu")  # CPU ranks need no GPU
    with pytest.raises(ConfigError) as exc:
        state.check_local_gpus(3, "cuda")
    assert exc.value.exit_code == 2 and "\n" not in str(exc.value)
    assert str(exc.value).startswith("3 ranks on this node but 2 CUDA device(s) visible")


def test_a_rank_past_the_gpus_is_refused_instead_of_wrapped(two_gpus, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match="3 ranks on this node but 2 CUDA device"):
        state.pick_device("cuda")


def test_the_launcher_refuses_before_starting_workers(two_gpus, monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "_detect_gpu", lambda device: "none")
    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: pytest.fail("workers were started"))
    recipe = load_recipe("tiny_cpu_ep2", [f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.run_dir={tmp_path / 'run'}",
                                           "system.device=auto", "parallelism.expert_model_parallel_size=1"])
    with pytest.raises(ConfigError, match="4 ranks on this node but 2 CUDA device"):
        launch.train(recipe, nproc_per_node=4)
    assert not (tmp_path / "ckpt").exists()  # no lock taken, nothing written
