"""Fixtures for every test: the leak check that runs after each test, and the run cache."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def no_leaked_saved_tensor_hooks():
    """After every test: no saved-tensor hook may stay installed (a leaked group or chunk scope
    would capture the tensors of every later test)."""
    yield
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()  # keep the next tests independent
        pytest.fail(f"a saved-tensor hook was left installed: {top[0]!r}")


@pytest.fixture(scope="session")
def run_cache() -> dict:
    """Runs several tests compare against (a baseline without offload, one offloaded run), by key.

    Session-scoped instead of a module global, so pytest owns its lifetime; no test mutates a run.
    """
    return {}
