"""What a group keeps per saved tensor: `SavedRef` (autograd's handle) and `Storage` (one storage).

Saved tensors that share one storage are copied once: the group copies the byte span of the
storage that its views use and rebuilds each view (dtype, shape, stride, offset) on reload.
When autograd drops the last `SavedRef` of a storage, the group frees that storage's copies.
"""

from __future__ import annotations

import weakref
from typing import Any, Collection, Protocol

import torch

from ._torch_compat import free_weak_storage
from .host_pool import HostBuffer

__all__ = [
    "SPAN_ALIGN", "EmptyTensors", "KeptRef", "SavedRef", "Storage", "alive", "byte_view", "check_version", "copy_pairs",
    "fix_spans", "same_view", "version_probe",
]  # fmt: skip

# Alignment of a copied span's start, so that every view's offset stays a whole number of
# its elements whatever dtypes view the storage (all element sizes divide 16).
SPAN_ALIGN = 16


class SavedOwner(Protocol):
    """What a `SavedRef` needs of the group that owns its storage (an `OffloadGroup`; typed here,
    below it, so that this module does not import the group's)."""

    handler: Any
    input_nodes: Collection

    def storage_freed(self, storage: "Storage") -> None: ...


class Storage:
    """One device storage saved in a group (through one or more views) and its copies."""

    __slots__ = (
        "key", "first", "more", "start", "nbytes", "device_bytes", "layout", "host", "host_offset", "on_host", "live", "pinned", "weak",
    )  # fmt: skip

    def __init__(self, key: int) -> None:
        self.key = key
        # Weak references to the SavedRefs of the views saved in it (autograd owns them): the
        # first one, and a list only for a storage saved through several views (rare), so that
        # the common case allocates no list per saved tensor.
        self.first: weakref.ref[SavedRef] | None = None
        self.more: list[weakref.ref[SavedRef]] | None = None
        self.start = 0
        self.nbytes = 0
        self.device_bytes: torch.Tensor | None = None  # what is copied on device: a uint8 span, or the saved view itself
        self.layout: tuple[torch.dtype, torch.Size] | None = None  # set when copied as the view itself (NOTE [Direct copies])
        self.host: HostBuffer | None = None
        self.host_offset = 0  # where its bytes start in ``host`` (a group slab's slice)
        self.on_host = False  # the host copy is the only one (counted in `ResidentBytes.host`)
        self.live = 0  # SavedRefs autograd still holds
        self.pinned = False  # kept on device: copying would free nothing (NOTE [Storages held elsewhere])
        self.weak: int | None = None  # a weak handle on the device storage while its offload is checked

    def add(self, ref: "SavedRef") -> None:
        """Count ``ref``, a view saved in this storage, as live."""
        if self.first is None:
            self.first = weakref.ref(ref)
        elif self.more is None:
            self.more = [weakref.ref(ref)]
        else:
            self.more.append(weakref.ref(ref))
        self.live += 1

    def fix_span(self) -> int:
        """Set ``start`` and ``nbytes`` to the byte span the live views use (its start aligned to
        `SPAN_ALIGN`): what is copied. Returns how many views are alive (0: autograd dropped all)."""
        only = self.only_view()
        if only is not None:  # the common case: one view saved
            start, end = only.span()
            views = 1
        else:
            refs = alive(self)
            if not refs:
                return 0
            starts, ends = zip(*[ref.span() for ref in refs])
            start, end = min(starts), max(ends)
            views = len(refs)
        start -= start % SPAN_ALIGN
        self.start = start
        self.nbytes = end - start if end > start else 0
        return views

    def only_view(self) -> "SavedRef | None":
        """The live SavedRef when exactly one view was saved in this storage (the common case,
        read without building `alive`'s list); None otherwise."""
        first = self.first
        return first() if first is not None and self.more is None else None

    def hold_aliases(self) -> "tuple[int, torch.Tensor | None]":
        """Hold each live view's original as a detached alias (same storage and version counter,
        nothing else kept alive: NOTE [Storages held elsewhere]'s probe counts references to the
        storage); how many, and one of them (None: no original held)."""
        count, alias = 0, None
        for ref in alive(self):
            if ref.tensor is not None:
                ref.tensor = alias = ref.tensor.detach()
                count += 1
        return count, alias

    def moved_to_host(self, no_memory: torch.Tensor) -> None:
        """The host copy became the only one: drop the device span and every live view's original
        (``no_memory``: `SavedRef.drop_original`'s empty tensor on their device)."""
        self.device_bytes = None
        self.on_host = True
        shape = None if self.layout is None else self.layout[1]
        only = self.only_view()
        if only is not None:
            only.drop_original(no_memory, shape)
        else:
            for ref in alive(self):
                ref.drop_original(no_memory, shape)

    def view_of(self, ref: "SavedRef") -> torch.Tensor:
        """``ref``'s saved view on the device copy: the copy itself where the storage was copied
        as that view (NOTE [Direct copies] in copies.py), else rebuilt on the byte span."""
        device_bytes = self.device_bytes
        if self.layout is not None:
            return device_bytes
        # uint8 bytes: their storage offset is where they start in it (a group slab's slice: NOTE [Group slabs] in slab.py)
        offset = (ref.offset_bytes - self.start + device_bytes.storage_offset()) // ref.dtype.itemsize
        return torch.empty(0, dtype=ref.dtype, device=device_bytes.device).set_(
            device_bytes.untyped_storage(), offset, ref.size, ref.stride
        )

    def drop(self) -> None:
        """Forget the device copy, the weak handle and the saved views (the storage was freed or discarded)."""
        self.device_bytes = None
        if self.weak is not None:
            free_weak_storage(self.weak)
            self.weak = None
        self.first = self.more = None


class SavedRef:
    """What the saved-tensor hook hands autograd for one offloaded tensor."""

    __slots__ = ("group", "storage", "tensor", "version", "probe", "dtype", "size", "stride", "offset_bytes", "__weakref__")

    def __init__(self, group: SavedOwner, storage: Storage, tensor: torch.Tensor) -> None:
        self.storage: Storage | None = None  # set once counted live: `__del__` uncounts only then
        self.group = group
        # The original's memory, held until the device copy is released (see `held`). A tensor
        # whose node existed when the group opened (a group input, unchanged) cannot be the
        # output of the node saving it, so it is held as it is, like one without a node.
        node = tensor.grad_fn
        self.tensor: torch.Tensor | None = tensor if node is None or node in group.input_nodes else tensor.detach()
        self.version = tensor._version
        # While the original is held, its version counter and its view (dtype, size, stride,
        # offset) are read from it; `drop_original` records them with a storage-less probe of the
        # counter, so that groups kept on device never pay for either.
        self.probe: torch.Tensor | None = None
        storage.add(self)
        self.storage = storage

    def drop_original(self, no_memory: torch.Tensor, shape: torch.Size | None = None) -> None:
        """Stop holding the device original; keep a probe of its version counter (``no_memory``: an
        empty tensor on the original's device, see `version_probe`) and what unpack needs of its
        view: all of it where the storage was copied as bytes (`Storage.view_of` rebuilds the view);
        only its ``shape``, for a version error, where it was copied as this view (NOTE [Direct copies])."""
        tensor = self.tensor
        if tensor is not None:
            if shape is None:
                self.dtype = tensor.dtype
                self.size = tensor.size()
                self.stride = tensor.stride()
                self.offset_bytes = tensor.storage_offset() * tensor.element_size()
            else:
                self.size = shape  # the storage's, no new object: one fewer for the garbage collector
            self.probe = version_probe(tensor, no_memory)
            self.tensor = None

    def check_version(self, group_name: str) -> None:
        """Raise autograd's error if the saved tensor changed in place since it was saved."""
        if self.tensor is not None:
            check_version(self.tensor, self.version, self.tensor.shape, group_name)
        elif self.probe is not None:  # neither: the group was discarded, and unpack says so
            check_version(self.probe, self.version, self.size, group_name)

    def span(self) -> tuple[int, int]:
        """Bytes ``[start, end)`` of the storage this view touches (the original must be held)."""
        tensor = self.tensor
        if tensor.is_contiguous():  # also an empty tensor: nbytes is 0
            start = tensor.storage_offset() * tensor.element_size()
            return start, start + tensor.nbytes
        itemsize = tensor.element_size()
        start = tensor.storage_offset() * itemsize
        if tensor.numel() == 0:
            return start, start
        extent = 1
        for n, s in zip(tensor.shape, tensor.stride()):  # a loop: no generator frame per dimension on the pack path
            extent += (n - 1) * s
        return start, start + extent * itemsize

    def __del__(self) -> None:
        storage = self.storage
        if storage is not None:
            storage.live -= 1
            if not storage.live:
                self.group.storage_freed(storage)


class KeptRef:
    """What the pack hook hands autograd for a saved tensor the policy leaves on device."""

    __slots__ = ("tensor", "version", "group_name")

    def __init__(self, tensor: torch.Tensor, group_name: str) -> None:
        self.tensor = held(tensor)
        self.version = tensor._version
        self.group_name = group_name

    def unpack(self) -> torch.Tensor:
        """The saved tensor, after autograd's in-place check."""
        tensor = self.tensor
        if tensor._version != self.version:
            check_version(tensor, self.version, tensor.shape, self.group_name)
        return tensor


def held(tensor: torch.Tensor) -> torch.Tensor:
    """What a saved-tensor reference may hold of ``tensor`` without keeping its graph alive.

    A tensor with a grad_fn is held as a detached alias (same storage and version counter):
    holding a saved *output* itself would make a cycle (tensor -> its node -> the reference ->
    tensor) through autograd's C++ graph that the garbage collector cannot see, so a graph that
    is never run backward, or retained (retain_graph, zero-bubble input-gradient steps), would
    never be freed. A tensor without one (a parameter, data) cannot form that cycle and is held
    as it is, which costs no new tensor per save.
    """
    return tensor if tensor.is_leaf else tensor.detach()  # is_leaf: no Python object for the node


def version_probe(tensor: torch.Tensor, no_memory: torch.Tensor) -> torch.Tensor:
    """A tensor sharing ``tensor``'s version counter that holds none of its memory.

    Autograd checks saved tensors for in-place changes only when no saved-tensor hooks are
    installed, so the hooks must check themselves, also after the original tensor is gone.
    ``no_memory``: an empty tensor on ``tensor``'s device, of any dtype, shared by every probe
    (`EmptyTensors`): the probe takes its empty storage and keeps its own version counter, and
    only that counter is ever read.
    """
    probe = tensor.detach()  # shares the version counter
    probe.data = no_memory  # keeps the counter, drops the storage
    return probe


class EmptyTensors:
    """One empty tensor per device, for `version_probe` (one group's probes share it)."""

    __slots__ = ("_by_device",)

    def __init__(self) -> None:
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        """The empty tensor on ``device``."""
        empty = self._by_device.get(device)
        if empty is None:
            empty = self._by_device[device] = torch.empty(0, dtype=torch.uint8, device=device)
        return empty


def check_version(probe: torch.Tensor, version: int, size, group_name: str) -> None:
    """Raise autograd's error if the tensor behind ``probe`` changed in place since it was saved."""
    if probe._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: saved tensor of shape {list(size)} in offload group {group_name!r} is at "
            f"version {probe._version}; expected version {version} instead."
        )


def fix_spans(storages: dict[int, Storage], kept: set[int] | None, held: Collection[int] | None) -> tuple[int, int, int, int]:
    """At a group's commit: fix the span of each storage a view is alive in, drop the others from
    ``storages``, and pin those the policy keeps (``kept``: their keys) or that another reference
    holds (``held``: ordinals among the live ones, NOTE [Storages held elsewhere]).

    Returns the saved bytes, the bytes pinned (saved, never moved), the views in pinned
    storages, and of the pinned bytes those held elsewhere.
    """
    saved_bytes = kept_bytes = kept_views = held_bytes = 0
    dropped = None
    ordinal = -1
    for key, storage in storages.items():
        views = storage.fix_span()
        if not views:  # autograd already dropped every view saved in this storage
            dropped = [] if dropped is None else dropped
            dropped.append(key)
            continue
        ordinal += 1
        if kept is not None and key in kept:
            storage.pinned = True
        elif held is not None and ordinal in held:
            storage.pinned = True
            held_bytes += storage.nbytes
        saved_bytes += storage.nbytes
        if storage.pinned:
            kept_views += views
            kept_bytes += storage.nbytes
    if dropped is not None:
        for key in dropped:
            del storages[key]
    return saved_bytes, kept_bytes, kept_views, held_bytes


def alive(storage: Storage) -> list[SavedRef]:
    """The SavedRefs of ``storage`` that autograd still holds."""
    first = storage.first() if storage.first is not None else None
    refs = [first] if first is not None else []
    if storage.more is not None:
        refs += [ref for weak in storage.more if (ref := weak()) is not None]
    return refs


def same_view(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether ``tensor`` views its storage exactly as ``other`` does (dtype, shape, strides, offset)."""
    return tensor is other or (
        tensor.dtype == other.dtype
        and tensor.storage_offset() == other.storage_offset()
        and tensor.shape == other.shape
        and tensor.stride() == other.stride()
    )


def byte_view(tensor: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over bytes ``[start, start + nbytes)`` of ``tensor``'s storage.

    No `torch.no_grad` block (it costs more than the view): a fresh tensor that does not require
    grad records nothing in autograd when `set_` points it at the storage.
    """
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage(), start, (nbytes,), (1,))


def copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src, non_blocking=True)`` for each ``(dst, src)``: one group's copies, issued
    in one launch. No pair requires grad (`copies.view_device_bytes`), so no copy records history."""
    for dst, src in pairs:
        dst.copy_(src, non_blocking=True)
