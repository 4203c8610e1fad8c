"""What a group keeps per saved tensor: `SavedRef` (autograd's handle) and `Storage` (one storage).

Saved tensors that share one storage are copied once: the group copies the byte span of the
storage that its views use and rebuilds each view (dtype, shape, stride, offset) on reload.
When autograd drops the last `SavedRef` of a storage, the group frees that storage's copies.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from .host_pool import HostBuffer
from .streams import Mark

if TYPE_CHECKING:
    from .group import OffloadGroup

__all__ = ["SavedRef", "Storage", "alive", "byte_view", "check_version", "version_probe"]


class Storage:
    """One device storage saved in a group (through one or more views) and its copies."""

    __slots__ = ("key", "refs", "start", "nbytes", "device_bytes", "host", "on_host", "live", "save_mark", "pinned")

    def __init__(self, key: int, save_mark: Mark | None) -> None:
        self.key = key
        self.refs: list[weakref.ref[SavedRef]] = []  # weak: autograd owns the SavedRefs
        self.start = 0
        self.nbytes = 0
        self.device_bytes: torch.Tensor | None = None  # uint8 span on device (original or reloaded)
        self.host: HostBuffer | None = None
        self.on_host = False  # the host copy is the only one (counted in `ResidentBytes.host`)
        self.live = 0  # SavedRefs autograd still holds
        self.save_mark = save_mark  # last compute moment a view of it was saved (R1)
        self.pinned = False  # another view of it stays on device in this group: copying frees nothing


class SavedRef:
    """What the saved-tensor hook hands autograd for one offloaded tensor."""

    __slots__ = ("group", "storage", "tensor", "version", "probe", "dtype", "size", "stride", "offset_bytes", "__weakref__")

    def __init__(self, group: "OffloadGroup", storage: Storage, tensor: torch.Tensor) -> None:
        self.group = group
        self.storage = storage
        # The original's memory, held until the device copy is released. A detached alias (same
        # storage and version counter, no grad_fn): holding a saved *output* itself would make a
        # cycle (tensor -> its node -> this ref -> tensor) that a retained graph (retain_graph,
        # zero-bubble input-gradient steps) never frees by reference counting.
        self.tensor: torch.Tensor | None = tensor.detach()
        self.version = tensor._version
        # Autograd's version counter is read through ``tensor`` while it is held, and through a
        # storage-less probe made when the original is dropped (`drop_original`), so that groups
        # kept on device never pay for one.
        self.probe: torch.Tensor | None = None
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset_bytes = tensor.storage_offset() * tensor.element_size()

    def drop_original(self) -> None:
        """Stop holding the device original, keeping a probe of its version counter."""
        if self.tensor is not None:
            self.probe = version_probe(self.tensor)
            self.tensor = None

    def check_version(self, group_name: str) -> None:
        """Raise autograd's error if the saved tensor changed in place since it was saved."""
        counter = self.tensor if self.tensor is not None else self.probe
        if counter is not None:  # neither: the group was discarded, and unpack says so
            check_version(counter, self.version, self.size, group_name)

    def span(self) -> tuple[int, int]:
        """Bytes ``[start, end)`` of the storage this view touches."""
        if self.tensor.numel() == 0:
            return self.offset_bytes, self.offset_bytes
        extent = 1 + sum((n - 1) * s for n, s in zip(self.size, self.stride))
        return self.offset_bytes, self.offset_bytes + extent * self.tensor.element_size()

    def __del__(self) -> None:
        group = self.group
        if group is not None:
            group._ref_freed(self.storage)


def version_probe(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor sharing ``tensor``'s version counter that holds none of its memory.

    Autograd checks saved tensors for in-place changes only when no saved-tensor hooks are
    installed, so the hooks must check themselves, also after the original tensor is gone.
    """
    probe = tensor.detach()  # shares the version counter
    probe.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)  # keeps the counter, drops the storage
    return probe


def check_version(probe: torch.Tensor, version: int, size, group_name: str) -> None:
    """Raise autograd's error if the tensor behind ``probe`` changed in place since it was saved."""
    if probe._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: saved tensor of shape {list(size)} in offload group {group_name!r} is at "
            f"version {probe._version}; expected version {version} instead."
        )


def alive(storage: Storage) -> list[SavedRef]:
    return [ref for weak in storage.refs if (ref := weak()) is not None]


def byte_view(tensor: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over bytes ``[start, start + nbytes)`` of ``tensor``'s storage."""
    with torch.no_grad():
        return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
            tensor.untyped_storage(), start, (nbytes,), (1,)
        )
