"""One host buffer of the pool and the size classes buffers come in.

A request of ``nbytes`` is served by a buffer of its size class (NOTE [Host pool bound] in
`host_pool.py`); the buffer keeps the event of the last copy that read it (its fence).
"""

from __future__ import annotations

import torch

from .streams import Event

__all__ = ["ROUND_BYTES", "HostBuffer", "size_class"]

ROUND_BYTES = 512
"""Every size class is a multiple of this many bytes."""

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
# `OffloadManager.close` trims its pool, so a closed manager someone still holds holds no buffer.
# Pinned pools use power-of-two classes so that pool bytes, the cap and the allocator's blocks
# agree (a finer class would still hold a whole power-of-two block).


def size_class(nbytes: int, per_doubling: int) -> int:
    """Bytes of the size class of a request of ``nbytes``: 512-byte units, ``per_doubling`` classes per doubling."""
    units = max(1, -(-nbytes // ROUND_BYTES))
    if units <= per_doubling:
        return units * ROUND_BYTES
    granule = (1 << ((units - 1).bit_length() - 1)) // per_doubling
    return -(-units // granule) * granule * ROUND_BYTES


class HostBuffer:
    """A host byte buffer of ``nbytes`` (maybe larger ``capacity``) and its reuse fence.

    ``holders``: the group storages whose copies live in it: one when the pool hands it out, as
    many as share it in a group slab (NOTE [Group slabs] in slab.py); it goes back to the pool
    when the last lets go (`slab.release_host`).
    """

    __slots__ = ("tensor", "nbytes", "capacity", "pooled", "fence", "last_used", "holders", "_views")

    def __init__(self, tensor: torch.Tensor | None, nbytes: int, pooled: bool, capacity: int | None = None) -> None:
        self.tensor = tensor
        self.nbytes = nbytes
        self.capacity = tensor.numel() if capacity is None else capacity
        self.pooled = pooled
        self.fence: Event | None = None
        self.last_used = 0  # the pool's acquire count when it was last handed out
        self.holders = 1
        # The views made, by (offset, bytes) or (offset, dtype, shape): a buffer is handed out
        # again and again for the same sizes (the same layer's tensors each iteration), and slicing
        # costs more than the copy of a small tensor. Bounded: cleared past _MAX_VIEWS entries.
        self._views: dict[tuple, torch.Tensor] = {}

    def view(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` as a uint8 tensor (default: the first ``nbytes``)."""
        if nbytes is None:
            nbytes = self.nbytes
        key = (offset, nbytes)
        view = self._views.get(key)
        if view is None:
            view = self._keep(key, self.tensor[offset : offset + nbytes])
        return view

    def typed_view(self, dtype: torch.dtype, shape: torch.Size, offset: int = 0) -> torch.Tensor:
        """The bytes from ``offset`` as a contiguous tensor of ``dtype`` and ``shape``, for a copy
        of a saved view as it is (NOTE [Direct copies] in copies.py); ``offset`` a multiple of
        the dtype's size."""
        key = (offset, dtype, shape)
        view = self._views.get(key)
        if view is None:
            nbytes = shape.numel() * dtype.itemsize
            view = self._keep(key, self.tensor[offset : offset + nbytes].view(dtype).view(shape))
        return view

    def _keep(self, key: tuple, view: torch.Tensor) -> torch.Tensor:
        views = self._views
        if len(views) >= _MAX_VIEWS:
            views.clear()
        views[key] = view
        return view

    def drop(self) -> None:
        """Let go of the memory: it returns to the allocator (NOTE [Releasing host memory])."""
        self.fence = None
        self.tensor = None
        self._views = {}


_MAX_VIEWS = 32
"""Views a `HostBuffer` keeps (the storages of one slab, over a few shapes)."""
