"""Group slabs: a small group's storages share one host buffer and come back in one device buffer.

NOTE [Group slabs]
A committed group that copies two or more storages whose spans, each started at a multiple of
`SLAB_ALIGN`, fit in `OffloadConfig.group_slab_bytes` (default 32 MiB) takes one host buffer (its
slab) from the pool instead of one per storage, and each storage's copy to host writes its slice
of it. Its reload, when every one of those storages is still saved, allocates one device buffer,
issues one host-to-device copy of the whole slab, and gives each storage its slice of that
buffer as its device copy (a view of it). Per group this saves, for each storage beyond the
first, a pool acquire and release, a device allocation and a copy launch (``cudaMemcpyAsync``):
the host path's per-tensor work that small groups, which the link moves in microseconds, pay most for (NOTE [CUDA host path] in streams/cuda.py). Large
groups keep one buffer per storage: their copies outlast a launch by far, and a slab of several
large spans would round up to a larger pinned size class than its parts.

Memory: the device slab returns to the allocator once autograd dropped every storage in it
(their views share it). The saved tensors of one module call are used by its backward together,
so a module group's storages are freed together anyway; in a layer group the slab holds the
earlier-freed storages until its last one is freed, at most ``group_slab_bytes`` per group, which the
saved-bytes accounting does not count (docs/report.md). A storage autograd drops before the
reload leaves its slice unused: the group then reloads the others one by one from their slices
(no device memory for a dead slice). The slab returns to the pool when its last holder lets
go (`HostBuffer.holders`), with the fence of the copy that read it last (rule R3): the reload's,
or the offload's when every storage was freed before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from .host_buffer import ROUND_BYTES, HostBuffer

if TYPE_CHECKING:
    from .host_pool import HostPool
    from .saved import Storage
    from .streams import Event

__all__ = ["SLAB_ALIGN", "release_host", "slab_offsets", "slab_of", "slab_views"]

SLAB_ALIGN = ROUND_BYTES
"""Where each storage's slice starts: the caching allocator's alignment, so a slice serves any kernel
that a tensor of its own would (and every dtype's view of it starts on a whole element)."""


def slab_offsets(storages: Sequence["Storage"], limit: int) -> tuple[list[int], int] | None:
    """Each storage's offset in the group's slab and the slab's bytes (a multiple of `SLAB_ALIGN`);
    None when the group copies one storage or its slab would exceed ``limit``."""
    if len(storages) < 2:
        return None
    offsets = []
    end = 0
    for storage in storages:
        offsets.append(end)
        end += _slice_bytes(storage.nbytes)
    return (offsets, end) if end <= limit else None


def _slice_bytes(nbytes: int) -> int:
    """The bytes a storage of ``nbytes`` takes in a slab: up to the next slice's aligned start."""
    return -(-nbytes // SLAB_ALIGN) * SLAB_ALIGN


def slab_of(storages: Sequence["Storage"]) -> HostBuffer | None:
    """The host slab that exactly ``storages`` hold (every storage still in it is reloaded now);
    None when they sit in buffers of their own or some of the slab's storages were freed."""
    if len(storages) < 2:
        return None
    slab = storages[0].host
    if slab is None or slab.holders != len(storages):
        return None
    spanned = 0
    for storage in storages:
        if storage.host is not slab:
            return None
        spanned += _slice_bytes(storage.nbytes)
    return slab if spanned == slab.nbytes else None  # less: a storage freed before left its slice


def slab_views(storages: Sequence["Storage"], device_slab: torch.Tensor) -> None:
    """Give each of ``storages`` its slice of ``device_slab`` (their reload, NOTE [Group slabs]):
    the view it was saved as where it was copied as that view (NOTE [Direct copies] in copies.py),
    else its bytes."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    for storage in storages:
        offset = storage.host_offset
        layout = storage.layout
        if layout is None:
            storage.device_bytes = device_slab[offset : offset + storage.nbytes]
            continue
        dtype, shape = layout
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = device_slab.view(dtype)
        # One view op per storage: a contiguous view of ``shape`` at its slice, the strides a new
        # tensor of that shape would have (what the reload without a slab allocates).
        strides = []
        stride = 1
        for size in reversed(shape):
            strides.append(stride)
            stride *= size if size > 1 else 1
        strides.reverse()
        storage.device_bytes = whole.as_strided(shape, strides, offset // dtype.itemsize)


def release_host(pool: "HostPool", storage: "Storage", fence: "Event | None") -> None:
    """``storage`` lets go of its host buffer; the buffer returns to ``pool`` with ``fence`` (the
    event of the last copy that reads it) once no storage holds it (NOTE [Group slabs])."""
    buf = storage.host
    storage.host = None
    buf.holders -= 1
    if not buf.holders:
        pool.release(buf, fence)
