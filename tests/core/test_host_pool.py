"""`HostPool`: reuse by size class, fences, the cap and its two exhaustion modes, releases, validation, counters."""

from __future__ import annotations

import re
import threading
import warnings

import pytest
import torch

from chunk_offload import ChunkOffloadError, HostPoolStats
from chunk_offload.core import HostPool
from chunk_offload.core import Event
from chunk_offload.core.host_pool import size_class


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


def test_acquire_rounds_to_512_and_counts():
    pool = HostPool()
    assert pool.stats() == _stats()
    buf = pool.acquire(1000)
    assert buf.nbytes == 1000
    assert buf.capacity == 1024
    assert buf.pooled is True
    assert buf.fence is None
    assert buf.tensor.dtype == torch.uint8 and buf.tensor.numel() == 1024
    assert buf.tensor.device == torch.device("cpu")
    view = buf.view()
    assert view.shape == (1000,) and view.dtype == torch.uint8
    assert view.untyped_storage().data_ptr() == buf.tensor.untyped_storage().data_ptr()
    assert pool.stats() == _stats(allocated=1024, in_use=1024, allocations=1)
    exact = pool.acquire(512)
    assert exact.capacity == 512
    assert pool.stats() == _stats(allocated=1536, in_use=1536, allocations=2)


def test_release_and_reuse_by_size_returns_the_same_buffer_with_its_fence():
    pool = HostPool()
    buf = pool.acquire(1000)
    fence = Event(None, None)
    pool.release(buf, fence)
    assert pool.stats() == _stats(allocated=1024, in_use=0, allocations=1)
    again = pool.acquire(600)  # 600 rounds to 1024 as well
    assert again is buf
    assert again.nbytes == 600 and again.view().numel() == 600
    assert again.fence is fence, "the fence must stay with the buffer until the next writer waited on it"
    assert pool.stats() == _stats(allocated=1024, in_use=1024, allocations=1)


def test_a_reused_buffer_views_the_size_of_each_request():
    # A buffer keeps its last view (HostBuffer.view): a request of another size in the same class
    # must still see exactly its own bytes, in the buffer's memory.
    pool = HostPool()
    buf = pool.acquire(1000)
    buf.view().fill_(7)
    pool.release(buf, None)
    again = pool.acquire(600)
    assert again is buf and again.view().numel() == 600 and again.view().data_ptr() == buf.tensor.data_ptr()
    again.view().fill_(3)
    pool.release(again, None)
    last = pool.acquire(1000)
    assert last is buf and last.view().numel() == 1000
    assert torch.equal(last.view(), torch.tensor([3] * 600 + [7] * 400, dtype=torch.uint8))


def test_other_size_allocates_a_new_buffer():
    pool = HostPool()
    small = pool.acquire(100)
    pool.release(small, None)
    large = pool.acquire(2000)
    assert large is not small
    assert large.capacity == 2048
    assert pool.stats() == _stats(allocated=512 + 2048, in_use=2048, allocations=2)
    assert pool.acquire(512) is small  # 512 rounds to the free 512-byte buffer
    assert pool.stats() == _stats(allocated=512 + 2048, in_use=2560, allocations=2)


def test_several_free_buffers_of_one_size_are_all_reused():
    pool = HostPool()
    bufs = [pool.acquire(700) for _ in range(3)]
    for buf in bufs:
        pool.release(buf, None)
    again = [pool.acquire(1024) for _ in range(3)]
    assert {id(b) for b in again} == {id(b) for b in bufs}
    assert pool.stats() == _stats(allocated=3072, in_use=3072, allocations=3)


def test_fallback_at_cap_warns_once_and_counts():
    pool = HostPool(capacity_bytes=1024, on_exhausted="fallback")
    first = pool.acquire(1024)
    assert first.pooled
    with pytest.warns(UserWarning, match=r"host pool at its cap") as record:
        extra1 = pool.acquire(300)
        extra2 = pool.acquire(2000)
        extra3 = pool.acquire(512)
    ours = [w for w in record if "host pool at its cap" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in record]
    assert "capacity_bytes=1024" in str(ours[0].message)
    assert "300 bytes requested (512 rounded)" in str(ours[0].message)
    assert [b.pooled for b in (extra1, extra2, extra3)] == [False, False, False]
    assert extra1.nbytes == 300 and extra1.capacity == 512
    assert pool.stats() == _stats(allocated=1024, in_use=1024, allocations=1, fallbacks=3, fallback_in_use=512 + 2048 + 512)
    pool.release(extra2, None)
    assert pool.stats() == _stats(allocated=1024, in_use=1024, allocations=1, fallbacks=3, fallback_in_use=1024)
    pool.release(extra1, None)
    pool.release(extra3, None)
    assert pool.stats() == _stats(allocated=1024, in_use=1024, allocations=1, fallbacks=3, fallback_in_use=0)
    # Unpooled buffers are not kept: the next over-cap request allocates again, silently now.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        extra4 = pool.acquire(300)
    assert extra4 is not extra1 and not extra4.pooled
    assert pool.stats() == _stats(allocated=1024, in_use=1024, allocations=1, fallbacks=4, fallback_in_use=512)
    pool.release(extra4, None)
    # Pooled buffers are still reused under the cap, without a warning.
    pool.release(first, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pool.acquire(1000) is first
    assert pool.stats() == _stats(allocated=1024, in_use=1024, allocations=1, fallbacks=4, fallback_in_use=0)


def test_error_at_cap_raises_before_allocating():
    pool = HostPool(capacity_bytes=1536, on_exhausted="error")
    held = pool.acquire(1024)
    before = pool.stats()
    assert before == _stats(allocated=1024, in_use=1024, allocations=1)
    with pytest.raises(ChunkOffloadError) as info:
        pool.acquire(600)
    message = str(info.value)
    assert "host pool exhausted" in message
    assert "600 bytes requested (1024 rounded)" in message
    assert "1024 of capacity_bytes=1536 already allocated" in message
    assert "1024 in use" in message
    assert "on_exhausted='fallback'" in message
    assert pool.stats() == before, "a refused request must not allocate or count anything"
    assert pool.acquire(512).capacity == 512  # what still fits is served
    assert pool.stats() == _stats(allocated=1536, in_use=1536, allocations=2)
    pool.release(held, None)
    assert pool.acquire(700) is held


def test_cap_zero_with_error_refuses_everything():
    pool = HostPool(capacity_bytes=0, on_exhausted="error")
    with pytest.raises(ChunkOffloadError, match=r"1 bytes requested \(512 rounded\), 0 of capacity_bytes=0"):
        pool.acquire(1)
    assert pool.stats() == _stats()


def test_invalid_on_exhausted_lists_choices():
    with pytest.raises(ChunkOffloadError, match=r"on_exhausted='drop' is not valid; choose one of \('fallback', 'error'\)"):
        HostPool(on_exhausted="drop")


def test_negative_capacity_is_rejected():
    with pytest.raises(ChunkOffloadError, match=r"capacity_bytes must be >= 0 or None, got -1"):
        HostPool(capacity_bytes=-1)


def test_no_cap_never_falls_back():
    pool = HostPool(capacity_bytes=None, on_exhausted="error")
    bufs = [pool.acquire(1 << 16) for _ in range(8)]
    assert all(b.pooled for b in bufs)
    assert pool.stats() == _stats(allocated=8 << 16, in_use=8 << 16, allocations=8)


def test_unpinned_on_cpu():
    buf = HostPool(pin_memory=False).acquire(10)
    assert not buf.tensor.is_pinned()


def test_concurrent_acquire_release_keeps_counters_exact():
    pool = HostPool()
    errors: list[BaseException] = []

    def worker(size: int) -> None:
        try:
            for _ in range(200):
                pool.release(pool.acquire(size), None)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    # Sizes whose class rounding wastes little (512 and 4096 bytes): the headroom bound (NOTE [Host
    # pool bound]) then never releases a free buffer, which a later acquire would allocate again.
    threads = [threading.Thread(target=worker, args=(s,)) for s in (500, 4000, 500, 4000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    stats = pool.stats()
    assert stats.in_use_bytes == 0
    assert stats.fallback_allocations == 0
    # At most one buffer per thread of each size was ever needed.
    assert stats.allocations <= 4
    assert stats.allocated_bytes <= 2 * 512 + 2 * 4096


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "value, shown, kind",
    [("1GiB", "'1GiB'", "str"), (2.5, "2.5", "float"), (float("nan"), "nan", "float"), (True, "True", "bool")],
)
def test_capacity_of_a_wrong_type_is_rejected_naming_it(value, shown, kind):
    with pytest.raises(ChunkOffloadError) as info:
        HostPool(capacity_bytes=value)
    message = str(info.value)
    assert message.startswith("chunk_offload: HostPool capacity_bytes must be an int number of bytes >= 0 or None")
    assert f"got {shown} ({kind})" in message
    assert "1 << 30" in message and "None for no cap" in message


def test_negative_capacity_message_says_what_is_accepted():
    with pytest.raises(ChunkOffloadError) as info:
        HostPool(capacity_bytes=-5)
    assert str(info.value) == (
        "chunk_offload: host pool capacity_bytes must be >= 0 or None, got -5; pass a byte count, or None for no cap"
    )


@pytest.mark.parametrize("value", ["bogus", 1, None, ["fallback"]])
def test_on_exhausted_must_be_one_of_the_choices(value):
    with pytest.raises(ChunkOffloadError) as info:
        HostPool(on_exhausted=value)
    assert str(info.value) == f"chunk_offload: on_exhausted={value!r} is not valid; choose one of ('fallback', 'error')"


@pytest.mark.parametrize(
    "options, expected",
    [
        (dict(pin_memory=1), "HostPool pin_memory must be True or False, got 1"),
        (dict(classes_per_doubling=3), "HostPool classes_per_doubling=3 is not valid; choose one of (1, 2, 4, 8, 16)"),
        (dict(classes_per_doubling=True), "HostPool classes_per_doubling=True is not valid"),
        (dict(idle_acquires=0), "HostPool idle_acquires must be an int >= 1, got 0"),
        (dict(idle_acquires=1.5), "HostPool idle_acquires must be an int >= 1, got 1.5"),
    ],
)
def test_other_options_are_checked(options, expected):
    with pytest.raises(ChunkOffloadError, match=re.escape(expected)):
        HostPool(**options)


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


# ----------------------------------------------------------------------------- a lowered cap, request sizes


class _PendingFence:
    """A fence whose copy is still running until `finish` (``query`` False, ``synchronize`` finishes it)."""

    def __init__(self) -> None:
        self.done = False
        self.mark = None

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


@pytest.mark.parametrize("on_exhausted", ["error", "fallback"])
def test_a_lowered_cap_frees_released_buffers_and_refuses_beyond_it(on_exhausted):
    pool = HostPool(on_exhausted=on_exhausted)
    held = [pool.acquire(4096) for _ in range(4)]
    pool.set_capacity(4096)  # below what is in use: nothing is taken back now
    assert pool.stats() == _stats(allocated=4 * 4096, in_use=4 * 4096, allocations=4)
    for buf in held:
        pool.release(buf, None)
    # Released buffers above the cap are freed, not kept free: the pool ends within the cap.
    assert pool.stats() == _stats(allocated=4096, allocations=4, evictions=3, freed=3 * 4096)
    first = pool.acquire(4096)
    assert first.pooled
    if on_exhausted == "error":
        with pytest.raises(ChunkOffloadError, match=r"host pool exhausted: 4096 bytes requested .* of capacity_bytes=4096"):
            pool.acquire(4096)
    else:
        with pytest.warns(UserWarning, match="host pool at its cap"):
            assert not pool.acquire(4096).pooled
    assert pool.stats().allocated_bytes == 4096


def test_a_buffer_released_over_a_lowered_cap_is_freed_once_its_copy_is_done():
    pool = HostPool(on_exhausted="error")
    a, b = pool.acquire(4096), pool.acquire(4096)
    pool.set_capacity(4096)
    fence = _PendingFence()
    pool.release(a, fence)  # its copy still reads it: neither freed nor free
    assert a.tensor is not None and pool.stats().allocated_bytes == 2 * 4096
    with pytest.raises(ChunkOffloadError, match="host pool exhausted"):
        pool.acquire(4096)  # b is in use and the cap is full: the draining buffer serves nothing
    fence.done = True
    pool.release(b, None)
    assert a.tensor is None, "released once its fence is done"
    assert pool.stats() == _stats(allocated=4096, allocations=2, evictions=1, freed=4096)
    assert pool.acquire(4096) is b


def test_making_room_under_a_lowered_cap_waits_for_a_draining_buffer():
    pool = HostPool()
    a, b = pool.acquire(4096), pool.acquire(4096)
    pool.set_capacity(4096)
    fence = _PendingFence()
    pool.release(a, fence)
    pool.release(b, _PendingFence())
    c = pool.acquire(2048)  # a new buffer needs room: the draining ones go, waiting on their copies
    assert c.pooled and fence.done
    stats = pool.stats()
    assert stats.allocated_bytes == 2048 and stats.eviction_waits == 2


def test_raising_the_cap_again_keeps_released_buffers():
    pool = HostPool()
    held = [pool.acquire(4096) for _ in range(2)]
    pool.set_capacity(4096)
    pool.set_capacity(None)
    for buf in held:
        pool.release(buf, None)
    assert pool.stats() == _stats(allocated=2 * 4096, allocations=2)


@pytest.mark.parametrize("nbytes", [-5, -1, 1.5, float("nan"), "1024", None, True, [8]])
def test_acquire_of_a_nonsense_size_is_a_value_error_at_the_call(nbytes):
    pool = HostPool()
    with pytest.raises(ValueError) as info:
        pool.acquire(nbytes)
    assert isinstance(info.value, ChunkOffloadError)
    message = str(info.value)
    assert message.startswith("chunk_offload: HostPool.acquire(nbytes=...) takes an int number of bytes >= 0")
    assert f"got {nbytes!r} ({type(nbytes).__name__})" in message
    assert pool.stats() == _stats()


def test_acquire_takes_zero_and_integer_types():
    pool = HostPool()
    assert pool.acquire(0).capacity == 512
    assert pool.acquire(torch.tensor(1000).item()).capacity == 1024
    import numpy as np

    assert pool.acquire(np.int64(700)).nbytes == 700


def test_the_cap_name_in_exhaustion_messages_is_what_set_the_cap():
    pool = HostPool(capacity_bytes=512, on_exhausted="error", cap_name="host_pool_bytes")
    pool.acquire(512)
    with pytest.raises(ChunkOffloadError, match=r"512 of host_pool_bytes=512 .* Raise host_pool_bytes,") as info:
        pool.acquire(512)
    assert "capacity_bytes" not in str(info.value)
    pool.set_capacity(1024, cap_name="--chunk-offload-host-budget's share")
    pool.acquire(512)
    with pytest.raises(ChunkOffloadError, match=r"of --chunk-offload-host-budget's share=1024"):
        pool.acquire(512)
