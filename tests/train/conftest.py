"""Training tests run tiny models; one intra-op thread per process avoids oversubscribing the CI's 2 cores
(the multi-process tests already run one thread per rank)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
