"""Suite-wide settings: one intra-op thread per test process.

CI has 2 cores shared by the pytest-xdist workers and the 2-process distributed tests; more torch
threads per process only oversubscribe them.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
