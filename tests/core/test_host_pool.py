"""`HostPool`: reuse by size, fences, the cap and its two exhaustion modes, releases, counters, and
validation of its options."""

from __future__ import annotations

import re
import threading
import warnings

import pytest
import torch

from chunk_offload import ChunkOffloadError
from chunk_offload.core import HostPool
from chunk_offload.core import Event
from tests.core._host_pool import _stats


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
