"""Fixtures shared by the core tests."""

from __future__ import annotations

import threading

import pytest

from chunk_offload import CpuStreams, OffloadConfig, OffloadManager
from tests.core._streams import JOIN_TIMEOUT_S, worker_threads


@pytest.fixture
def manager():
    """An `OffloadManager` with ``min_offload_bytes=1``, closed after the test."""
    mgr = OffloadManager(OffloadConfig(min_offload_bytes=1))
    yield mgr
    mgr.close()


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


@pytest.fixture
def make_streams():
    """Create CpuStreams; at teardown close them and join their worker threads."""
    created: list[tuple[CpuStreams, set[threading.Thread]]] = []

    def make(**kwargs) -> CpuStreams:
        before = worker_threads()
        backend = CpuStreams(**kwargs)
        created.append((backend, worker_threads() - before))
        return backend

    yield make
    for backend, threads in created:
        backend.close()
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)
            assert not thread.is_alive(), f"worker thread {thread.name} still running after close()"
