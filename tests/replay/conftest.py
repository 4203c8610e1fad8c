"""Stage-replay tests run on one thread: tiny matrices on a shared host gain nothing from more."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host's cores are shared; tiny matrices gain nothing from more
    yield
    torch.set_num_threads(threads)
