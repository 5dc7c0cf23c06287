"""Suite-wide settings: one intra-op thread per test process (GPTOSS_TEST_THREADS to change it).

CI has 2 cores shared by the pytest-xdist workers and the 2-process distributed tests; more torch
threads per process only oversubscribe them. GPTOSS_TEST_THREADS=2 re-runs the suite with two
threads per process, which changes the order of parallel reductions: the comparisons between code
paths must hold either way (tests/tolerances.py).
"""

import os

import pytest
import torch

TEST_THREADS = int(os.environ.get("GPTOSS_TEST_THREADS", "1"))


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(previous)
