"""Helpers shared by tests/core/test_bad_input.py and tests/core/test_close_with_an_error_in_flight.py."""

from __future__ import annotations

import torch
from torch import nn

from chunk_offload import OffloadConfig, OffloadManager


class UserError(Exception):
    pass


def _offloaded_manager() -> tuple[OffloadManager, nn.Module]:
    """A manager (``min_offload_bytes=1``) offloading a small module as group "m"."""
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    manager.offload_module(module, "m")
    return manager, module


def _forward_in_open_chunk(manager: OffloadManager, module: nn.Module) -> torch.Tensor:
    manager.begin_chunk(microbatch=0)
    return module(torch.randn(3, 4, requires_grad=True))
