"""One intra-op thread in the test process, like tests/train: the CI's 2 cores are shared with the
2-process tests."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
