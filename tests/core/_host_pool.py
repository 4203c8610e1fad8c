"""Helpers shared by the tests/core/test_host_pool*.py files."""

from __future__ import annotations

from chunk_offload import HostPoolStats


def _stats(allocated=0, in_use=0, allocations=0, fallbacks=0, fallback_in_use=0, evictions=0, freed=0, waits=0) -> HostPoolStats:
    return HostPoolStats(
        allocated_bytes=allocated,
        in_use_bytes=in_use,
        allocations=allocations,
        fallback_allocations=fallbacks,
        fallback_in_use_bytes=fallback_in_use,
        evictions=evictions,
        freed_bytes=freed,
        eviction_waits=waits,
    )
