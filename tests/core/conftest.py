"""Fixtures shared by the core tests."""

from __future__ import annotations

import pytest

from chunk_offload import OffloadManager


@pytest.fixture
def make_manager():
    """``make(**options)``: an `OffloadManager` (``min_offload_bytes=1`` unless given), closed after the test."""
    managers: list[OffloadManager] = []

    def make(**options) -> OffloadManager:
        options.setdefault("min_offload_bytes", 1)
        manager = OffloadManager(**options)
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.close()
