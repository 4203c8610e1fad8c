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
    """A host byte buffer of ``nbytes`` (maybe larger ``capacity``) and its reuse fence."""

    __slots__ = ("tensor", "nbytes", "capacity", "pooled", "fence", "last_used", "_view", "_typed")

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
        self._typed: tuple[torch.dtype, torch.Size, torch.Tensor] | None = None  # the last typed view made

    def view(self) -> torch.Tensor:
        """The first ``nbytes`` bytes as a uint8 tensor."""
        view = self._view
        if view is None or view.shape[0] != self.nbytes:
            view = self._view = self.tensor[: self.nbytes]
        return view

    def typed_view(self, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """The first ``nbytes`` bytes as a contiguous tensor of ``dtype`` and ``shape`` (whose
        bytes must be ``nbytes``), for a copy of a saved view as it is (NOTE [Direct copies]
        in copies.py). Kept like `view`: the same layer saves the same shape every iteration."""
        typed = self._typed
        if typed is not None and typed[0] == dtype and typed[1] == shape:
            return typed[2]
        view = self.tensor[: self.nbytes].view(dtype).view(shape)
        self._typed = (dtype, shape, view)
        return view

    def drop(self) -> None:
        """Let go of the memory: it returns to the allocator (NOTE [Releasing host memory])."""
        self.fence = None
        self.tensor = self._view = self._typed = None
