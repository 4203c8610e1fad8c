"""A group's copies: its saved storages to host at commit, and back to the device in backward.

Functions of the group's storages and the engine context, so that `OffloadGroup` keeps only
its states; each copy direction is one launch on its stream (one stream switch and one
timing per group: NOTE [CUDA host path] in streams/cuda.py), whose event is the timing's end
(NOTE [Timing end events] there).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from ._torch_compat import weak_storage
from .saved import Storage, alive, byte_view, copy_pairs, same_view
from .slab import release_host, slab_of, slab_offsets, slab_views

if TYPE_CHECKING:
    from .engine_context import EngineContext
    from .streams import Event, Mark

__all__ = ["copy_to_device", "copy_to_host", "host_view", "release_after_copy", "view_device_bytes"]

Wait = Callable[..., None]
"""`OffloadGroup._wait`: ``wait(stream, event, wait_name)``, skippable by name in tests."""


def view_device_bytes(ctx: "EngineContext", name: str, storages: Iterable[Storage]) -> tuple[list[Storage], "Mark | None"]:
    """The storages to copy, each given what its copy reads on device; and the compute mark after.

    NOTE [Direct copies]
    A storage saved through one contiguous view that covers its whole copied span (the common
    case: a fresh activation; also saved several times, as the same view, the way a layer group
    holds an output that one module saves and the next saves as its input) is copied as that
    view itself: to a host view of its dtype and
    shape, back into a new device tensor of that dtype and shape, which unpack then returns as
    it is. Any other storage (several views, strided or unaligned ones) is copied as a uint8
    byte span made with ``aten::set_`` and its views are rebuilt on it at unpack. Both copy the
    same bytes and give backward the same values, strides and offsets; the direct form saves
    per storage the byte view at the offload and the rebuilt view at each unpack, a tensor
    allocation and a ``set_`` call each on the host path (NOTE [CUDA host path]). Every unpack
    of a storage copied directly returns the one device copy, as autograd without offload would
    hand each node the one tensor.

    NOTE [Offload order]
    The CUDA sanitizer counts the ``set_`` that makes a byte view as a compute-stream write of
    the saved storage. So the views are made first and the returned compute mark follows them
    and every save: d2h waits on compute after it (R1 covers the views too), and the offload
    requires it. A view made after d2h's wait would race the copy that reads it.
    """
    copied: list[Storage] = []
    tensors = 0
    for storage in storages:
        if storage.pinned:
            continue
        only = storage.only_view()
        if only is not None:
            tensor, views, one_view = only.tensor, 1, True
        else:
            refs = alive(storage)
            tensor, views = refs[0].tensor, len(refs)
            one_view = all(same_view(ref.tensor, tensor) for ref in refs[1:])
        if one_view and tensor.nbytes == storage.nbytes and tensor.is_contiguous():
            # A group input is held as it is and may require grad: its copy must not record
            # history (a copy into a pooled host buffer would keep the graph alive).
            storage.device_bytes = tensor.detach() if tensor.requires_grad else tensor
            storage.layout = (tensor.dtype, tensor.shape)
        else:
            storage.device_bytes = byte_view(tensor, storage.start, storage.nbytes)
        storage.weak = weak_storage(tensor)  # NOTE [Storages held elsewhere]
        tensors += views
        copied.append(storage)
    ctx.stats.group(name).tensors_offloaded += tensors
    return copied, ctx.streams.compute.tick()


def host_view(storage: Storage) -> "torch.Tensor":
    """What ``storage``'s copies write or read on host (NOTE [Direct copies]; its slice of a group slab: NOTE [Group slabs])."""
    layout = storage.layout
    host = storage.host
    if layout is None:
        return host.view(storage.host_offset, storage.nbytes)
    return host.typed_view(layout[0], layout[1], storage.host_offset)


def copy_to_host(ctx: "EngineContext", name: str, storages: Iterable[Storage], wait: Wait) -> "Event":
    """Copy the group's unpinned storages into host buffers; the event of the copies."""
    streams = ctx.streams
    d2h = streams.d2h
    copied, viewed_mark = view_device_bytes(ctx, name, storages)
    if "offload_after_compute" not in ctx.skip_waits:
        d2h.wait_stream(streams.compute)
    d2h.require(viewed_mark, rule="R1", what="offload of {!r} reading a saved tensor or its byte view", subject=name)
    # Each buffer is held by its storages as soon as it is acquired: should a later acquire
    # raise (a full pool), the group is kept and autograd's free of its storages returns it.
    slab = slab_offsets(copied, ctx.slab_bytes)
    if slab is None:
        for storage in copied:
            storage.host = ctx.pool.acquire(storage.nbytes)
        buffers = [storage.host for storage in copied]
    else:  # NOTE [Group slabs]
        offsets, slab_bytes = slab
        shared = ctx.pool.acquire(slab_bytes)
        shared.holders = len(copied)
        for storage, offset in zip(copied, offsets):
            storage.host, storage.host_offset = shared, offset
        buffers = [shared]
    waited = None  # the fence last waited on: buffers released by one reload share its event
    for buf in buffers:
        fence = buf.fence
        if fence is not None and fence is not waited:
            wait(d2h, fence, "reuse_after_reload")
            d2h.require(fence.mark, rule="R3", what="offload of {!r} writing a reused host buffer", subject=name)
            waited = fence
    pairs = []
    nbytes = 0
    for storage in copied:
        pairs.append((host_view(storage), storage.device_bytes))
        nbytes += storage.nbytes
    event, timing = d2h.launch_recorded(functools.partial(copy_pairs, pairs), timed=ctx.measure_time, nbytes=nbytes)
    ctx.stats.timing(name, "offload_time_s", timing)
    ctx.stats.group(name).bytes_offloaded += nbytes
    return event


def copy_to_device(ctx: "EngineContext", name: str, storages: list[Storage], offload_event: "Event", wait: Wait) -> "Event":
    """Copy ``storages`` back from their host buffers into new device buffers; the event of the copies.

    The reload stream waits on the offload's event itself: compute released the originals
    without waiting on it (NOTE [Release by the copy stream]).
    """
    streams = ctx.streams
    h2d = streams.h2d
    device = streams.device
    nbytes = 0
    for storage in storages:
        nbytes += storage.nbytes
    # NOTE [Reload allocation]: reload buffers are allocated on the compute stream, so the caching
    # allocator frees them in compute order after their last use; the copy stream must therefore
    # wait on compute before writing them (R4).
    slab = slab_of(storages)
    if slab is not None:  # NOTE [Group slabs]
        device_slab = torch.empty(slab.nbytes, dtype=torch.uint8, device=device)
        slab_views(storages, device_slab)
        pairs = [(device_slab, slab.view())]
    else:
        pairs = []
        for storage in storages:
            layout = storage.layout
            if layout is None:
                device_bytes = torch.empty(storage.nbytes, dtype=torch.uint8, device=device)
            else:  # NOTE [Direct copies]
                device_bytes = torch.empty(layout[1], dtype=layout[0], device=device)
            pairs.append((device_bytes, host_view(storage)))
            storage.device_bytes = device_bytes
    alloc_mark = streams.compute.tick()
    if "reload_after_alloc" not in ctx.skip_waits:
        h2d.wait_stream(streams.compute)
    wait(h2d, offload_event, "reload_after_offload")
    h2d.require(alloc_mark, rule="R4", what="reload of {!r} writing its device buffer", subject=name)
    h2d.require(offload_event.mark, rule="R4", what="reload of {!r} reading a host buffer before its offload finished", subject=name)
    for storage in storages:
        storage.on_host = False
    event, timing = h2d.launch_recorded(functools.partial(copy_pairs, pairs), timed=ctx.measure_time, nbytes=nbytes)
    ctx.stats.timing(name, "reload_time_s", timing)
    ctx.stats.group(name).bytes_reloaded += nbytes
    ctx.resident.moved_to_device(nbytes)
    for storage in storages:
        release_host(ctx.pool, storage, event)
    return event


def release_after_copy(ctx: "EngineContext", name: str, storages: list[Storage], offload_event: "Event", wait: Wait, what: str) -> None:
    """Let compute drop the device originals of ``storages`` while their copy to host (``offload_event``) may still read them.

    NOTE [Release by the copy stream]
    A group's device originals are released at the next group's commit or at the chunk's
    forward end (NOTE [Release and prefetch order] in handler.py). By default compute does not
    wait for their copy to host: they are handed to the d2h stream (`Stream.retain`; on CUDA
    ``record_stream``, so the caching allocator reuses their memory only once the copies issued
    before the free are done; on CPU the copy holds them until it ran). Compute never stalls in
    forward on the link; while the link lags, the originals in flight stay allocated (the bytes a
    wait would have held as well) and their memory is reused as soon as their copy ends. The
    price: when that memory becomes free depends on the link's progress, not on the program
    alone, so the device peak may exceed the accounting by the bytes still in flight at the peak
    (R measures it). `OffloadConfig.deterministic_memory` restores the strict order: compute waits
    on the copy's event before the release (R2), memory follows the program, compute stalls where
    the link lags. Since compute no longer orders d2h before later work, a reload waits on the
    offload's event itself before it reads the host buffer (R4, ``reload_after_offload`` in
    `copy_to_device`), and the held-elsewhere check at the chunk's forward end first waits for
    every copy issued so far where copies hold their sources (`StreamBackend.copies_hold_sources`:
    a later group's copy of the same storage would hold it too).
    """
    if ctx.deterministic_memory or "release_after_offload" in ctx.skip_waits:  # (skipped: tests only)
        compute = ctx.streams.compute
        wait(compute, offload_event, "release_after_offload", "wait_time_s")
        compute.require(offload_event.mark, rule="R2", what=what, subject=name)
    else:
        ctx.streams.d2h.retain([storage.device_bytes for storage in storages])
