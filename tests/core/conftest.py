"""Fixtures shared by the core tests."""

from __future__ import annotations

import pytest

from chunk_offload import OffloadConfig, OffloadManager


@pytest.fixture
def make_manager():
    """``make(**fields)``: an `OffloadManager` of ``OffloadConfig(**fields)`` (``min_offload_bytes=1``
    unless given), closed after the test."""
    managers: list[OffloadManager] = []

    def make(**fields) -> OffloadManager:
        fields.setdefault("min_offload_bytes", 1)
        manager = OffloadManager(OffloadConfig(**fields))
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.close()
