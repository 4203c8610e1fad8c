"""`HostPool` under a cap lowered at run time, and the sizes `acquire` accepts; exhaustion messages name
what set the cap."""

from __future__ import annotations

import pytest
import torch

from chunk_offload import ChunkOffloadError
from chunk_offload.core import HostPool
from tests.core._host_pool import _stats


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
