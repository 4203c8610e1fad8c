"""Host buffers for offloaded tensors, reused across iterations and sizes, with bounded memory.

Allocating pinned memory (``cudaHostAlloc``) synchronizes the device, so buffers are kept
and handed out again. A buffer comes back with a *fence*, the event of the last copy that
read it; whoever writes it next must wait on that event first (rule R3 of NOTE
[Happens-before rules] in `streams.py`). Sizes are rounded to size classes and a free buffer
serves any request it holds with little waste, so changing shapes (sequence lengths, MoE
token counts) reuse buffers; free buffers beyond what the run has needed are released (NOTE
[Host pool bound]).
"""

from __future__ import annotations

import threading
import warnings
from typing import Literal

import torch

from .errors import ChunkOffloadError, internal_assert
from .host_buffer import ROUND_BYTES as _ROUND_BYTES
from .host_buffer import HostBuffer, size_class
from .host_pool_args import check_capacity, check_nbytes, check_options
from .stats import HostPoolStats
from .streams import Event

__all__ = ["HostBuffer", "HostPool", "HostPoolStats", "size_class"]

_HEADROOM = 2
"""Pool bytes are kept at most this factor of the peak requested bytes in use (NOTE [Host pool bound])."""
_REUSE_RATIO = 2
"""A free buffer serves a request of at least 1/this of its capacity (bounded waste)."""
_SCAN_EVERY = 256
"""Acquires between two scans for idle buffers (a scan also runs before each new allocation)."""

# NOTE [Host pool bound]
# Sizes round up to size classes: `per_doubling` classes between two powers of two of 512-byte
# units, so the rounding wastes < 1/per_doubling (pinned pools use powers of two, see NOTE
# [Releasing host memory] in `host_buffer.py`). A request takes, in order:
#   1. a free buffer of the smallest class in [class, max(class, 2 * nbytes)] (bounded waste);
#   2. a new buffer of its class, after releasing least-recently-used free buffers until the pool
#      holds at most _HEADROOM x the peak of requested bytes in use (all-time, this request
#      included). By induction the pool never holds more than max(2 x peak need, bytes in use),
#      and bytes in use are <= 2 x requested (step 1's waste bound, the class rounding, plus at
#      most 511 rounding bytes per buffer), so the pool stays within ~2x the largest need of any
#      iteration however the shapes change;
#   3. at the cap, first any larger free buffer (no waste bound), then free buffers are released
#      to make room (at the class size, or 512-byte rounding if only that fits). Exhaustion
#      (`on_exhausted`) is declared only when no free buffer holds the request and even with
#      every free buffer released the request would not fit: bytes in use + request > cap.
# Free buffers not handed out during the last `idle_acquires` acquires are released too (a scan
# every _SCAN_EVERY acquires and before each allocation), so a pool shrinks after a phase of
# larger shapes. Counting acquires needs no per-iteration call from the manager.
#
# A cap lowered below what the pool holds (`set_capacity`) is met as buffers come back: while the
# pool holds more than the cap, a released buffer is not kept free but released (at once if its
# fence is done, else once it is: `_draining`), so no free buffer above the cap can be handed out
# and a request beyond the cap meets `on_exhausted`. Once the pool is within the cap again, the
# free buffers fit in it and the fast path (a free buffer of the request's class) needs no check.
#
# R3 stays exact: a free buffer is released only when its fence (the last copy reading it) is
# done. Idle release skips buffers whose fence is pending (`query`, no wait); releasing to make
# room waits for the fence (`synchronize`) only when done buffers are not enough. That host wait
# happens only right before a new allocation, which on CUDA costs more than one copy's wait.



class HostPool:
    """Pinned (on CUDA hosts) byte buffers in size classes, bounded in bytes, with an optional cap.

    Args:
        capacity_bytes: most bytes the pool may hold; ``None`` for no cap.
        pin_memory: allocate page-locked memory (needed for asynchronous copies on CUDA).
        on_exhausted: at the cap, when no free buffer can serve, ``"fallback"`` allocates an
            unpooled buffer (one warning), ``"error"`` raises `ChunkOffloadError` before allocating.
        classes_per_doubling: size classes between two powers of two (waste < 1/this);
            ``None``: 1 (powers of two, as PyTorch's pinned allocator rounds) when pinned, else 4.
        idle_acquires: a free buffer not handed out during this many acquires is released.
        cap_name: what the user set to give the cap, named in exhaustion messages (the manager
            passes ``"OffloadConfig.host_pool_bytes"``).
    """

    def __init__(
        self,
        *,
        capacity_bytes: int | None = None,
        pin_memory: bool = False,
        on_exhausted: Literal["fallback", "error"] = "fallback",
        classes_per_doubling: int | None = None,
        idle_acquires: int = 4096,
        cap_name: str = "capacity_bytes",
    ) -> None:
        capacity = check_capacity(capacity_bytes)
        check_options(on_exhausted, pin_memory, classes_per_doubling, idle_acquires)
        self.capacity_bytes = capacity
        self.pin_memory = pin_memory
        self.on_exhausted = on_exhausted
        self.classes_per_doubling = classes_per_doubling or (1 if pin_memory else 4)
        self.idle_acquires = int(idle_acquires)
        self.cap_name = cap_name
        self._over_cap = False  # the pool holds more than a lowered cap (NOTE [Host pool bound])
        self._draining: list[HostBuffer] = []  # released over the cap, fence pending: released once done
        self._free: dict[int, list[HostBuffer]] = {}  # capacity -> free buffers (maybe none), most recently released last
        self._lock = threading.Lock()
        self._allocated = 0
        self._in_use = 0
        self._in_use_requested = 0
        self._peak_allocated = 0
        self._peak_requested = 0
        self._allocations = 0
        self._fallbacks = 0
        self._fallback_in_use = 0
        self._evictions = 0
        self._freed = 0
        self._eviction_waits = 0
        self._acquires = 0
        self._last_scan = 0
        self._warned = False

    # ------------------------------------------------------------------ acquire
    def acquire(self, nbytes: int) -> HostBuffer:
        """A buffer of at least ``nbytes``; its ``fence`` must be waited on before writing.

        ``nbytes`` must be an int >= 0 (`ChunkOffloadValueError`, a ``ValueError``, otherwise).
        """
        if type(nbytes) is not int or nbytes < 0:
            nbytes = check_nbytes(nbytes)
        per_doubling = self.classes_per_doubling
        size = size_class(nbytes, per_doubling)
        with self._lock:
            self._acquires += 1
            bufs = self._free.get(size)
            buf = bufs.pop() if bufs else self._take_near(nbytes, size)
            if buf is not None:
                if self._acquires - self._last_scan >= _SCAN_EVERY:
                    self._release_idle()
                self._hand_out(buf, nbytes)
                return buf
            new_size = self._make_room(nbytes, size)
            pooled = new_size is not None
            if pooled:
                self._allocated += new_size
                self._peak_allocated = max(self._peak_allocated, self._allocated)
                self._allocations += 1
            else:
                best = min((c for c, bufs in self._free.items() if bufs and c >= nbytes), default=None)
                if best is not None:  # at the cap: any free buffer that holds the request
                    buf = self._free[best].pop()
                    self._hand_out(buf, nbytes)
                    return buf
                self._exhausted(nbytes, size)
                new_size = _ROUND_BYTES * -(-nbytes // _ROUND_BYTES)
                self._fallbacks += 1
                self._fallback_in_use += new_size
            buf = HostBuffer(None, nbytes, pooled, new_size)
            if pooled:
                self._hand_out(buf, nbytes)
        buf.tensor = torch.empty(new_size, dtype=torch.uint8, pin_memory=self.pin_memory)
        return buf

    def _hand_out(self, buf: HostBuffer, nbytes: int) -> None:
        buf.nbytes, buf.holders = nbytes, 1
        buf.last_used = self._acquires
        self._in_use += buf.capacity
        requested = self._in_use_requested + nbytes
        self._in_use_requested = requested
        if requested > self._peak_requested:
            self._peak_requested = requested

    def _take_near(self, nbytes: int, size: int) -> HostBuffer | None:
        """The free buffer of the smallest class above ``size`` within the waste bound (NOTE [Host pool bound])."""
        limit = max(size, _REUSE_RATIO * nbytes)
        capacity = size_class(size + 1, self.classes_per_doubling)
        while capacity <= limit:
            bufs = self._free.get(capacity)
            if bufs:
                return bufs.pop()  # the most recently released: the least recently released age out
            capacity = size_class(capacity + 1, self.classes_per_doubling)
        return None

    def _make_room(self, nbytes: int, size: int) -> int | None:
        """Release free buffers so that a new one fits the bound and the cap; its size, or None at the cap."""
        cap = self.capacity_bytes
        if cap is not None and self._in_use + size > cap:
            if self._free_holding(nbytes):
                return None  # a free buffer can serve: take it rather than release anything
            size = _ROUND_BYTES * -(-nbytes // _ROUND_BYTES)
            if self._in_use + size > cap:
                return None
        self._release_idle()
        bound = _HEADROOM * max(self._peak_requested, self._in_use_requested + nbytes)
        limit = bound if cap is None else min(bound, cap)
        if self._allocated + size > limit:
            if cap is not None and self._allocated + size > cap and self._free_holding(nbytes):
                return None
            self._release_lru(self._allocated + size - limit)
        return size

    def _free_holding(self, nbytes: int) -> bool:
        return any(bufs and c >= nbytes for c, bufs in self._free.items())

    # ------------------------------------------------------------------ release of free buffers
    def _release_idle(self) -> None:
        """Release free buffers unused during the last ``idle_acquires`` acquires whose fence is done."""
        self._last_scan = self._acquires
        if self._draining:
            self._drain_done()
        horizon = self._acquires - self.idle_acquires
        for buf in [b for bufs in self._free.values() for b in bufs if b.last_used < horizon]:
            if buf.fence is None or buf.fence.query():
                self._evict(buf)

    def _release_lru(self, excess: int) -> None:
        """Release least-recently-used free buffers until ``excess`` bytes are gone (or none is free).

        Buffers whose fence is done go first; others are waited for on the host (NOTE [Host pool bound]).
        Buffers released over a lowered cap go before any free one.
        """
        while self._draining and excess > 0:
            buf = self._draining.pop(0)
            if buf.fence is not None and not buf.fence.query():
                buf.fence.synchronize()
                self._eviction_waits += 1
            self._forget(buf)
            excess -= buf.capacity
        order = sorted((b for bufs in self._free.values() for b in bufs), key=lambda b: b.last_used)
        done = [b for b in order if b.fence is None or b.fence.query()]
        done_ids = {id(b) for b in done}
        for buf in done + [b for b in order if id(b) not in done_ids]:
            if excess <= 0:
                return
            if id(buf) not in done_ids:
                buf.fence.synchronize()
                self._eviction_waits += 1
            self._evict(buf)
            excess -= buf.capacity

    def _evict(self, buf: HostBuffer) -> None:
        bufs = self._free[buf.capacity]
        bufs.remove(buf)
        if not bufs:
            del self._free[buf.capacity]
        self._forget(buf)

    def _forget(self, buf: HostBuffer) -> None:
        """Count ``buf``, no longer listed anywhere, as released; its fence is done."""
        self._allocated -= buf.capacity
        self._evictions += 1
        self._freed += buf.capacity
        buf.drop()  # the memory returns to the allocator (NOTE [Releasing host memory])
        cap = self.capacity_bytes
        if self._over_cap and (cap is None or self._allocated <= cap):
            self._over_cap = False

    def _drain_done(self) -> None:
        """Release the buffers released over a lowered cap whose fence is done; once the pool is
        within the cap, the others are free buffers again."""
        pending = []
        for buf in self._draining:
            if not self._over_cap:
                self._free.setdefault(buf.capacity, []).append(buf)
            elif buf.fence is None or buf.fence.query():
                self._forget(buf)
            else:
                pending.append(buf)
        self._draining = pending

    def set_capacity(self, capacity_bytes: int | None, *, cap_name: str | None = None) -> None:
        """Change the cap (``None``: no cap); free buffers above a lower cap are released now.

        Buffers in use are never taken back: until they are released the pool may hold more than
        the new cap; each one released meanwhile is freed rather than kept (NOTE [Host pool
        bound]), and new requests meet the new cap. Used by the integrations to apply a node's
        host budget once each rank's share is known (`chunk_offload.schedule.node_host_cap`);
        ``cap_name`` (what the user set) replaces the one exhaustion messages name.
        """
        capacity = check_capacity(capacity_bytes)
        with self._lock:
            self.capacity_bytes = capacity
            if cap_name is not None:
                self.cap_name = cap_name
            if capacity is not None and self._allocated > capacity:
                self._release_lru(self._allocated - capacity)
            self._over_cap = capacity is not None and self._allocated > capacity
            self._drain_done()

    def trim(self) -> int:
        """Release every free buffer now (waiting for copies still reading them); return the bytes released.

        On CUDA follow with ``torch.accelerator.empty_host_cache()`` to return the pinned pages
        to the system (that call synchronizes the device; NOTE [Releasing host memory] in `host_buffer.py`).
        """
        with self._lock:
            before = self._freed
            self._release_lru(self._allocated)
            return self._freed - before

    # ------------------------------------------------------------------ exhaustion, release, stats
    def _exhausted(self, nbytes: int, size: int) -> None:
        free = sum(c * len(bufs) for c, bufs in self._free.items())
        state = (
            f"{nbytes} bytes requested ({size} rounded), {self._allocated} of {self.cap_name}="
            f"{self.capacity_bytes} already allocated, {self._in_use} in use, {free} free in buffers "
            f"too small to hold it (largest {max((c for c, bufs in self._free.items() if bufs), default=0)})"
        )
        if self.on_exhausted == "error":
            raise ChunkOffloadError(
                f"host pool exhausted: {state}. Raise {self.cap_name}, offload fewer modules, "
                "or pass on_exhausted='fallback' to allocate unpooled buffers."
            )
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"chunk_offload: host pool at its cap ({state}); allocating unpooled host buffers, "
                "which is slower (each pinned allocation synchronizes the device). Raise "
                f"{self.cap_name} to avoid this.",
                stacklevel=4,
            )

    def release(self, buf: HostBuffer, fence: Event | None) -> None:
        """Give ``buf`` back; ``fence`` is the event of the last copy that reads it."""
        size = buf.capacity
        with self._lock:
            if not buf.pooled:
                self._fallback_in_use -= size
                return
            internal_assert(self._in_use >= size, f"pool release of {size} bytes with {self._in_use} in use")
            self._in_use -= size
            self._in_use_requested -= buf.nbytes
            buf.fence = fence
            if self._over_cap:  # a lowered cap: not kept free (NOTE [Host pool bound])
                self._draining.append(buf)
                self._drain_done()
                return
            self._free.setdefault(size, []).append(buf)

    def stats(self) -> HostPoolStats:
        with self._lock:
            return HostPoolStats(
                allocated_bytes=self._allocated,
                in_use_bytes=self._in_use,
                allocations=self._allocations,
                fallback_allocations=self._fallbacks,
                fallback_in_use_bytes=self._fallback_in_use,
                evictions=self._evictions,
                freed_bytes=self._freed,
                eviction_waits=self._eviction_waits,
                peak_allocated_bytes=self._peak_allocated,
                peak_requested_bytes=self._peak_requested,
            )
