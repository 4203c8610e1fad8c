"""`deterministic_kernels`: torch's deterministic kernels inside the block, the previous setting after it."""

from __future__ import annotations

import os

import pytest
import torch

from chunk_offload.devkit.deterministic import CUBLAS_WORKSPACE, deterministic_kernels


def test_deterministic_inside_restored_after_even_on_an_error(monkeypatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with pytest.raises(KeyError):
            with deterministic_kernels():
                assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
                raise KeyError("inside")
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE


def test_a_workspace_set_by_the_user_is_kept(monkeypatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with deterministic_kernels():
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert not torch.are_deterministic_algorithms_enabled()
