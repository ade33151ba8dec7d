"""Fixtures shared by the GLM-5.2 tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one thread is fastest, and steady on a shared, loaded machine (a module opts in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
