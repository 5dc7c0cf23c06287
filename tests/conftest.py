"""Suite-wide settings: one intra-op thread per test process (GPTOSS_TEST_THREADS to change it), and
derandomised property tests (HYPOTHESIS_PROFILE=explore to draw new examples).

CI has 2 cores shared by the pytest-xdist workers and the 2-process distributed tests; more torch
threads per process only oversubscribe them. GPTOSS_TEST_THREADS=2 re-runs the suite with two
threads per process, which changes the order of parallel reductions: the comparisons between code
paths must hold either way (tests/tolerances.py).

torch.compile is off (TORCH_COMPILE_DISABLE=1, inherited by spawned workers and CLI subprocesses):
a recipe's `model.swiglu_kernel: auto` would otherwise compile the clamped SwiGLU in every training
process, seconds each on 2 cores; it falls back to the eager form without a warning.
tests/model/test_swiglu_kernel.py lifts it for the few tests that compile.

Hypothesis draws its examples from a fixed seed by default ("ci" profile): every run, in CI or
here, checks the same examples in the same time, and a failure reproduces by re-running. The
"explore" profile draws fresh random examples, more of them, to look for new failures locally.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

_COMMON = dict(database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", derandomize=True, **_COMMON)
settings.register_profile("explore", derandomize=False, max_examples=1000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TEST_THREADS = int(os.environ.get("GPTOSS_TEST_THREADS", "1"))


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """gptoss's cache (a LoRA base's hash, checkpoint/formats/training/record.py) in a temporary folder, never
    the user's; spawned workers and CLI subprocesses inherit it."""
    previous = os.environ.get("GPTOSS_CACHE_DIR")
    os.environ["GPTOSS_CACHE_DIR"] = str(tmp_path_factory.mktemp("gptoss-cache"))
    yield
    if previous is None:
        os.environ.pop("GPTOSS_CACHE_DIR", None)
    else:
        os.environ["GPTOSS_CACHE_DIR"] = previous


@pytest.fixture(autouse=True, scope="session")
def _no_torch_compile():
    """TORCH_COMPILE_DISABLE=1 for the session (see the module's docstring)."""
    previous = os.environ.get("TORCH_COMPILE_DISABLE")
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    yield
    if previous is None:
        os.environ.pop("TORCH_COMPILE_DISABLE", None)
    else:
        os.environ["TORCH_COMPILE_DISABLE"] = previous
