"""`HostPool` size classes and reuse across sizes: rounding waste, larger free buffers serving smaller
requests, and making room by releasing done buffers before waiting on pending ones."""

from __future__ import annotations

import pytest

from chunk_offload import ChunkOffloadError
from chunk_offload.core import HostPool
from chunk_offload.core import Event
from chunk_offload.core.host_pool import size_class
from tests.core._host_pool import _stats


# ----------------------------------------------------------------------------- size classes and reuse across sizes


@pytest.mark.parametrize("per_doubling", [1, 2, 4, 8, 16])
def test_size_classes_bound_the_rounding_waste(per_doubling):
    previous = 0
    for nbytes in list(range(1, 70_000, 97)) + [1 << 20, (1 << 20) + 1, 3 << 20]:
        size = size_class(nbytes, per_doubling)
        assert size % 512 == 0 and size >= nbytes
        units = -(-nbytes // 512)
        # Waste below one class step: < 1/per_doubling of the request, or within the 512-byte unit.
        assert size <= 512 * units * (1 + 1 / per_doubling) or size == 512 * units, (nbytes, size)
        assert size >= previous, "classes grow with the request"
        previous = size
    assert size_class((1 << 20) + 1, 1) == 2 << 20  # powers of two, as PyTorch's pinned allocator rounds
    assert [size_class(512 * u, 4) // 512 for u in range(1, 18)] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 10, 12, 12, 14, 14, 16, 16, 20]


def test_pinned_pool_uses_power_of_two_classes_and_unpinned_four_per_doubling():
    assert HostPool(pin_memory=False).classes_per_doubling == 4
    assert HostPool(classes_per_doubling=1).acquire(5 * 512).capacity == 8 * 512
    assert HostPool().acquire(5 * 512).capacity == 5 * 512
    assert HostPool().acquire(9 * 512).capacity == 10 * 512


def test_a_larger_free_buffer_serves_a_request_of_at_least_half_its_size():
    pool = HostPool()
    big = pool.acquire(8 * 512)
    pool.release(big, None)
    assert pool.acquire(4 * 512) is big, "8 units hold a 4-unit request within the 2x waste bound"
    pool.release(big, None)
    small = pool.acquire(4 * 512 - 1)
    assert small is not big, "under half its size: a new buffer of the request's class instead"
    assert small.capacity == 4 * 512
    assert pool.stats() == _stats(allocated=12 * 512, in_use=4 * 512, allocations=2)


class _Fence(Event):
    """A fence whose copy completes when the test says so; counts host waits."""

    def __init__(self) -> None:
        super().__init__(None, None)
        self.done = False
        self.waits = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def test_growing_requests_keep_the_pool_within_twice_the_need():
    pool = HostPool()
    fence = _Fence()
    fence.done = True
    peak = 0
    for step in range(1, 60):
        nbytes = 1000 * step * step  # grows 3600x: the exact-size pool kept every size
        buf = pool.acquire(nbytes)
        peak = max(peak, nbytes)
        pool.release(buf, fence)
        stats = pool.stats()
        assert stats.allocated_bytes <= 2 * peak, (step, stats)
        assert stats.peak_requested_bytes == peak
    assert stats.evictions > 0 and stats.freed_bytes > 0
    assert stats.allocations - stats.evictions == len([b for bufs in pool._free.values() for b in bufs])


def test_making_room_releases_done_buffers_first_and_waits_only_when_needed():
    pool = HostPool()
    a, b = pool.acquire(4096), pool.acquire(4096)
    pending, done = _Fence(), _Fence()
    done.done = True
    pool.release(a, pending)  # least recently used, but its reload is still running
    pool.release(b, done)
    # Need so far 8192: a 16 KiB request may take the pool to 2 x 16 KiB, no release needed.
    c = pool.acquire(16384)
    assert pool.stats().evictions == 0
    pool.release(c, None)
    # A 40 KiB request: bound 80 KiB, 24 KiB held + 40 KiB fits, still nothing released.
    d = pool.acquire(40960)
    assert pool.stats().evictions == 0
    # Holding d, a 48 KiB request: need 88 KiB, bound 176 KiB: still fits (64 + 48 KiB).
    e = pool.acquire(49152)
    pool.release(d, None)
    pool.release(e, None)
    assert pool.stats().evictions == 0 and pending.waits == 0
    # trim() releases everything, waiting for the pending copy exactly once.
    freed = pool.trim()
    assert freed == 4096 + 4096 + 16384 + 40960 + 49152
    assert pending.waits == 1 and done.waits == 0
    assert pool.stats().allocated_bytes == 0 and pool.stats().eviction_waits == 1
    assert a.tensor is None and b.tensor is None


def test_release_to_make_room_takes_done_buffers_before_pending_ones():
    pool = HostPool(capacity_bytes=3 * 4096, on_exhausted="error")
    bufs = [pool.acquire(4096) for _ in range(3)]
    fences = [_Fence() for _ in range(3)]
    fences[2].done = True
    for buf, fence in zip(bufs, fences):
        pool.release(buf, fence)
    new = pool.acquire(4096 + 1)  # class 5120: no free buffer holds it, two must go
    assert new.capacity == 5120
    assert pool.stats().evictions == 2 and pool.stats().eviction_waits == 1
    assert bufs[2].tensor is None, "the buffer whose copy is done goes first"
    assert bufs[0].tensor is None and bufs[1].tensor is not None, "then the least recently used"
    assert [f.waits for f in fences] == [1, 0, 0]
    pool.release(new, None)
    bigger = pool.acquire(3 * 4096)  # everything free must go; the pending copy is waited for
    assert [f.waits for f in fences] == [1, 1, 0]
    assert pool.stats().allocated_bytes == 3 * 4096 and bigger.pooled and bigger.capacity == 3 * 4096


def test_at_the_cap_a_larger_free_buffer_serves_before_exhaustion():
    pool = HostPool(capacity_bytes=8192, on_exhausted="error")
    big = pool.acquire(8192)
    pool.release(big, None)
    # 1000 bytes: class 1024, no room to allocate, the free 8 KiB buffer is beyond the waste bound
    # but can serve: it is handed out rather than raising or releasing it.
    assert pool.acquire(1000) is big
    with pytest.raises(ChunkOffloadError, match=r"host pool exhausted: 1000 bytes requested \(1024 rounded\)"):
        pool.acquire(1000)
    assert pool.stats() == _stats(allocated=8192, in_use=8192, allocations=1)


def test_at_the_cap_free_buffers_are_released_to_make_room():
    pool = HostPool(capacity_bytes=4096, on_exhausted="error")
    small = [pool.acquire(1024) for _ in range(4)]
    for buf in small:
        pool.release(buf, None)
    big = pool.acquire(4096)  # the old pool raised here with 4 KiB free
    assert big.pooled and big.capacity == 4096
    assert pool.stats() == _stats(allocated=4096, in_use=4096, allocations=5, evictions=4, freed=4096)


def test_idle_buffers_are_released_after_idle_acquires():
    pool = HostPool(idle_acquires=10)
    old = pool.acquire(8192)
    pool.release(old, None)
    for _ in range(300):  # past the next scan: 300 acquires of another size
        pool.release(pool.acquire(100), None)
    assert old.tensor is None
    assert pool.stats() == _stats(allocated=512, allocations=2, evictions=1, freed=8192)
