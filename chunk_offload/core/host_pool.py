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

import numbers
import threading
import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch

from .errors import ChunkOffloadError, internal_assert
from .streams import Event

__all__ = ["HostBuffer", "HostPool", "HostPoolStats", "size_class"]

_ROUND_BYTES = 512
_VALID_ON_EXHAUSTED = ("fallback", "error")
_VALID_CLASSES = (1, 2, 4, 8, 16)
_HEADROOM = 2
"""Pool bytes are kept at most this factor of the peak requested bytes in use (NOTE [Host pool bound])."""
_REUSE_RATIO = 2
"""A free buffer serves a request of at least 1/this of its capacity (bounded waste)."""
_SCAN_EVERY = 256
"""Acquires between two scans for idle buffers (a scan also runs before each new allocation)."""

# NOTE [Host pool bound]
# Sizes round up to size classes: `per_doubling` classes between two powers of two of 512-byte
# units, so the rounding wastes < 1/per_doubling (pinned pools use powers of two, see NOTE
# [Releasing host memory]). A request takes, in order:
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
# R3 stays exact: a free buffer is released only when its fence (the last copy reading it) is
# done. Idle release skips buffers whose fence is pending (`query`, no wait); releasing to make
# room waits for the fence (`synchronize`) only when done buffers are not enough. That host wait
# happens only right before a new allocation, which on CUDA costs more than one copy's wait.
#
# NOTE [Releasing host memory]
# On CUDA, `torch.empty(pin_memory=True)` goes through PyTorch's CachingHostAllocator: a new block
# is `cudaHostAlloc`ed at the next power of two of the request; a freed tensor's block returns to
# that allocator's free list (no CUDA call, no device sync) and is reused, for a request of the
# same power of two, once the events recorded by the copies that used it are done. So releasing
# a pool buffer never synchronizes the device and a later allocation of that class costs no
# `cudaHostAlloc`; but the pinned pages stay in the process until
# `torch.accelerator.empty_host_cache()`, which `cudaFreeHost`s every cached block and
# synchronizes the device (like any `cudaFreeHost`). The pool never calls it; a user who wants the
# memory back calls `HostPool.trim()` then `empty_host_cache()` at a quiet point (e.g. before eval).
# Pinned pools use power-of-two classes so that pool bytes, the cap and the allocator's blocks
# agree (a finer class would still hold a whole power-of-two block).


def size_class(nbytes: int, per_doubling: int) -> int:
    """Bytes of the size class of a request of ``nbytes``: 512-byte units, ``per_doubling`` classes per doubling."""
    units = max(1, -(-nbytes // _ROUND_BYTES))
    if units <= per_doubling:
        return units * _ROUND_BYTES
    granule = (1 << ((units - 1).bit_length() - 1)) // per_doubling
    return -(-units // granule) * granule * _ROUND_BYTES


class HostBuffer:
    """A host byte buffer of ``nbytes`` (maybe larger ``capacity``) and its reuse fence."""

    __slots__ = ("tensor", "nbytes", "capacity", "pooled", "fence", "last_used", "_view")

    def __init__(self, tensor: torch.Tensor | None, nbytes: int, pooled: bool, capacity: int | None = None) -> None:
        self.tensor = tensor
        self.nbytes = nbytes
        self.capacity = tensor.numel() if capacity is None else capacity
        self.pooled = pooled
        self.fence: Event | None = None
        self.last_used = 0  # the pool's acquire count when it was last handed out
        # The last view made: a buffer is handed out again and again for the same size (the same
        # layer's tensor each iteration), and slicing costs more than the copy of a small tensor.
        self._view: torch.Tensor | None = None

    def view(self) -> torch.Tensor:
        """The first ``nbytes`` bytes as a uint8 tensor."""
        view = self._view
        if view is None or view.shape[0] != self.nbytes:
            view = self._view = self.tensor[: self.nbytes]
        return view


@dataclass(frozen=True)
class HostPoolStats:
    """Byte counts of a `HostPool`."""

    allocated_bytes: int
    """Bytes of host memory the pool holds (in use or free)."""
    in_use_bytes: int
    """Bytes of pooled buffers handed out and not yet released."""
    allocations: int
    """Number of pooled host allocations made so far (flat once the shapes repeat)."""
    fallback_allocations: int
    """Number of unpooled allocations made because the pool was at its cap."""
    fallback_in_use_bytes: int
    """Bytes of unpooled fallback buffers handed out and not yet released."""
    evictions: int = 0
    """Number of free buffers released (idle, or to make room; NOTE [Host pool bound])."""
    freed_bytes: int = 0
    """Bytes of the free buffers released so far."""
    eviction_waits: int = 0
    """Releases that first waited on the host for the copy still reading the buffer."""
    peak_allocated_bytes: int = field(default=0, compare=False)
    """Most bytes the pool ever held (a high-water mark: not compared by ``==``)."""
    peak_requested_bytes: int = field(default=0, compare=False)
    """Most requested (unrounded) bytes ever in use at once: the run's largest need (not compared)."""


def _check_capacity(capacity_bytes: object) -> int | None:
    if capacity_bytes is None:
        return None
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, numbers.Integral):
        raise ChunkOffloadError(
            f"HostPool capacity_bytes must be an int number of bytes >= 0 or None, got {capacity_bytes!r} "
            f"({type(capacity_bytes).__name__}); pass e.g. 1 << 30 for 1 GiB, or None for no cap"
        )
    if capacity_bytes < 0:
        raise ChunkOffloadError(
            f"host pool capacity_bytes must be >= 0 or None, got {capacity_bytes!r}; pass a byte count, or None for no cap"
        )
    return int(capacity_bytes)


def _check_options(on_exhausted: object, pin_memory: object, per_doubling: object, idle_acquires: object) -> None:
    if not isinstance(on_exhausted, str) or on_exhausted not in _VALID_ON_EXHAUSTED:
        raise ChunkOffloadError(f"on_exhausted={on_exhausted!r} is not valid; choose one of {_VALID_ON_EXHAUSTED}")
    if not isinstance(pin_memory, bool):
        raise ChunkOffloadError(f"HostPool pin_memory must be True or False, got {pin_memory!r}")
    if per_doubling is not None and (isinstance(per_doubling, bool) or per_doubling not in _VALID_CLASSES):
        raise ChunkOffloadError(
            f"HostPool classes_per_doubling={per_doubling!r} is not valid; choose one of {_VALID_CLASSES}, "
            "or None (1 when pinned, else 4)"
        )
    if isinstance(idle_acquires, bool) or not isinstance(idle_acquires, numbers.Integral) or idle_acquires < 1:
        raise ChunkOffloadError(f"HostPool idle_acquires must be an int >= 1, got {idle_acquires!r}")


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
    """

    def __init__(
        self,
        *,
        capacity_bytes: int | None = None,
        pin_memory: bool = False,
        on_exhausted: Literal["fallback", "error"] = "fallback",
        classes_per_doubling: int | None = None,
        idle_acquires: int = 4096,
    ) -> None:
        capacity = _check_capacity(capacity_bytes)
        _check_options(on_exhausted, pin_memory, classes_per_doubling, idle_acquires)
        self.capacity_bytes = capacity
        self.pin_memory = pin_memory
        self.on_exhausted = on_exhausted
        self.classes_per_doubling = classes_per_doubling or (1 if pin_memory else 4)
        self.idle_acquires = int(idle_acquires)
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
        """A buffer of at least ``nbytes``; its ``fence`` must be waited on before writing."""
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
        buf.nbytes = nbytes
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
        horizon = self._acquires - self.idle_acquires
        for buf in [b for bufs in self._free.values() for b in bufs if b.last_used < horizon]:
            if buf.fence is None or buf.fence.query():
                self._evict(buf)

    def _release_lru(self, excess: int) -> None:
        """Release least-recently-used free buffers until ``excess`` bytes are gone (or none is free).

        Buffers whose fence is done go first; others are waited for on the host (NOTE [Host pool bound]).
        """
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
        self._allocated -= buf.capacity
        self._evictions += 1
        self._freed += buf.capacity
        buf.fence = None
        buf.tensor = buf._view = None  # the memory returns to the allocator (NOTE [Releasing host memory])

    def set_capacity(self, capacity_bytes: int | None) -> None:
        """Change the cap (``None``: no cap); free buffers above a lower cap are released now.

        Buffers in use are never taken back: until they are released the pool may hold more than
        the new cap, and new requests meet the cap as usual. Used by the integrations to apply a
        node's host budget once each rank's share is known (`chunk_offload.schedule.node_host_cap`).
        """
        capacity = _check_capacity(capacity_bytes)
        with self._lock:
            self.capacity_bytes = capacity
            if capacity is not None and self._allocated > capacity:
                self._release_lru(self._allocated - capacity)

    def trim(self) -> int:
        """Release every free buffer now (waiting for copies still reading them); return the bytes released.

        On CUDA follow with ``torch.accelerator.empty_host_cache()`` to return the pinned pages
        to the system (that call synchronizes the device; NOTE [Releasing host memory]).
        """
        with self._lock:
            before = self._freed
            self._release_lru(self._allocated)
            return self._freed - before

    # ------------------------------------------------------------------ exhaustion, release, stats
    def _exhausted(self, nbytes: int, size: int) -> None:
        free = sum(c * len(bufs) for c, bufs in self._free.items())
        state = (
            f"{nbytes} bytes requested ({size} rounded), {self._allocated} of capacity_bytes="
            f"{self.capacity_bytes} already allocated, {self._in_use} in use, {free} free in buffers "
            f"too small to hold it (largest {max((c for c, bufs in self._free.items() if bufs), default=0)})"
        )
        if self.on_exhausted == "error":
            raise ChunkOffloadError(
                f"host pool exhausted: {state}. Raise host_pool_bytes, offload fewer modules, "
                "or pass on_exhausted='fallback' to allocate unpooled buffers."
            )
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"chunk_offload: host pool at its cap ({state}); allocating unpooled host buffers, "
                "which is slower (each pinned allocation synchronizes the device). Raise host_pool_bytes "
                "to avoid this.",
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
