"""Host buffers for offloaded tensors, reused across iterations.

Allocating pinned memory (``cudaHostAlloc``) synchronizes the device, so buffers are kept
and handed out again: every iteration of a training run offloads the same sizes, so after
the first iteration no host allocation happens. A buffer comes back with a *fence*, the
event of the last copy that read it; whoever writes it next must wait on that event first
(rule R3 of NOTE [Happens-before rules] in `streams.py`).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from .errors import ChunkOffloadError, internal_assert
from .streams import Event

__all__ = ["HostBuffer", "HostPool", "HostPoolStats"]

_ROUND_BYTES = 512
_VALID_ON_EXHAUSTED = ("fallback", "error")


class HostBuffer:
    """A host byte buffer of ``nbytes`` (maybe larger ``capacity``) and its reuse fence."""

    __slots__ = ("tensor", "nbytes", "capacity", "pooled", "fence")

    def __init__(self, tensor: torch.Tensor, nbytes: int, pooled: bool) -> None:
        self.tensor = tensor
        self.nbytes = nbytes
        self.capacity = tensor.numel()
        self.pooled = pooled
        self.fence: Event | None = None

    def view(self) -> torch.Tensor:
        """The first ``nbytes`` bytes as a uint8 tensor."""
        return self.tensor[: self.nbytes]


@dataclass(frozen=True)
class HostPoolStats:
    """Byte counts of a `HostPool`."""

    allocated_bytes: int
    """Bytes of host memory the pool holds (in use or free)."""
    in_use_bytes: int
    """Bytes of pooled buffers handed out and not yet released."""
    allocations: int
    """Number of pooled host allocations made so far (flat after the first iteration)."""
    fallback_allocations: int
    """Number of unpooled allocations made because the pool was at its cap."""
    fallback_in_use_bytes: int
    """Bytes of unpooled fallback buffers handed out and not yet released."""


class HostPool:
    """Pinned (on CUDA hosts) byte buffers, binned by size, with an optional byte cap.

    Args:
        capacity_bytes: most bytes the pool may hold; ``None`` for no cap.
        pin_memory: allocate page-locked memory (needed for asynchronous copies on CUDA).
        on_exhausted: at the cap, ``"fallback"`` allocates an unpooled buffer (one warning),
            ``"error"`` raises `ChunkOffloadError` before allocating.
    """

    def __init__(
        self,
        *,
        capacity_bytes: int | None = None,
        pin_memory: bool = False,
        on_exhausted: Literal["fallback", "error"] = "fallback",
    ) -> None:
        if on_exhausted not in _VALID_ON_EXHAUSTED:
            raise ChunkOffloadError(f"on_exhausted={on_exhausted!r} is not valid; choose one of {_VALID_ON_EXHAUSTED}")
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ChunkOffloadError(f"host pool capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = pin_memory
        self.on_exhausted = on_exhausted
        self._free: dict[int, list[HostBuffer]] = {}
        self._lock = threading.Lock()
        self._allocated = 0
        self._in_use = 0
        self._allocations = 0
        self._fallbacks = 0
        self._fallback_in_use = 0
        self._warned = False

    def acquire(self, nbytes: int) -> HostBuffer:
        """A buffer of at least ``nbytes``; its ``fence`` must be waited on before writing."""
        size = -(-nbytes // _ROUND_BYTES) * _ROUND_BYTES
        with self._lock:
            free = self._free.get(size)
            if free:
                buf = free.pop()
                buf.nbytes = nbytes
                self._in_use += size
                return buf
            if self.capacity_bytes is None or self._allocated + size <= self.capacity_bytes:
                self._allocated += size
                self._in_use += size
                self._allocations += 1
                pooled = True
            else:
                self._exhausted(nbytes, size)
                self._fallbacks += 1
                self._fallback_in_use += size
                pooled = False
        tensor = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
        return HostBuffer(tensor, nbytes, pooled)

    def _exhausted(self, nbytes: int, size: int) -> None:
        state = (
            f"{nbytes} bytes requested ({size} rounded), {self._allocated} of capacity_bytes="
            f"{self.capacity_bytes} already allocated, {self._in_use} in use"
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
            )
