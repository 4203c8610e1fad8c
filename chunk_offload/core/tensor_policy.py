"""What may be offloaded: large activations only, never parameters, buffers or their views."""

from __future__ import annotations

import torch
from torch import nn

from ._torch_compat import is_wrapper_subclass, key_of_storage, storage_key, view_base
from .errors import ChunkOffloadError

__all__ = ["OffloadPolicy", "mark_not_offloadable", "is_marked_not_offloadable"]

_KEEP_ATTR = "_chunk_offload_keep_on_device"


def mark_not_offloadable(tensor: torch.Tensor) -> torch.Tensor:
    """Keep ``tensor`` (and tensors that are views of it) on device when saved; returns it.

    The mark is kept on the tensor and on its storage, so views of views and aliases that share
    the storage (such as the detached aliases that group marks hand to a module) are kept too.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ChunkOffloadError(f"mark_not_offloadable(tensor=...) takes a torch.Tensor, got {tensor!r}")
    setattr(tensor, _KEEP_ATTR, True)
    if tensor.layout == torch.strided:
        setattr(tensor.untyped_storage(), _KEEP_ATTR, True)
    return tensor


def _carries_keep_mark(obj: object) -> bool:
    # Our own mark, Transformer Engine's `mark_not_offload` and Megatron-core's
    # `mark_not_offloadable` (plain attributes: honoured without importing either library).
    return (
        getattr(obj, _KEEP_ATTR, False)
        or getattr(obj, "_TE_do_not_offload", False)
        or getattr(obj, "offloading_activation", True) is False
    )


def is_marked_not_offloadable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``, the base it views or its storage carries a keep-on-device mark.

    Besides `mark_not_offloadable`, the marks of Transformer Engine (``_TE_do_not_offload``) and
    of Megatron-core's own offloading (``offloading_activation = False``) are honoured.
    """
    return _marked(tensor, tensor.untyped_storage() if tensor.layout == torch.strided else None)


def _marked(tensor: torch.Tensor, storage: torch.UntypedStorage | None) -> bool:
    if _carries_keep_mark(tensor):
        return True
    base = view_base(tensor)
    if base is not None and _carries_keep_mark(base):
        return True
    return storage is not None and bool(getattr(storage, _KEEP_ATTR, False))


_PLAIN_TYPES = (torch.Tensor, nn.Parameter, nn.Buffer)


def _plain_tensors(tensor: torch.Tensor):
    """The plain tensors holding the data of ``tensor``: itself, or for a wrapper subclass such as
    DTensor (FSDP2's sharded parameters) its inner tensors, whose storages are the real ones
    (a wrapper's own ``untyped_storage()`` raises)."""
    if is_wrapper_subclass(tensor):
        attrs, _ = tensor.__tensor_flatten__()
        for attr in attrs:
            inner = getattr(tensor, attr)
            if isinstance(inner, torch.Tensor):  # DTensor also lists its device mesh
                yield from _plain_tensors(inner)
    else:
        yield tensor


class OffloadPolicy:
    """Decides per saved tensor whether it is offloaded.

    Parameters and buffers are recognised by *storage*, not by type: ``weight.t()`` is a plain
    tensor but shares the weight's storage, and copying it out would free nothing. The storages
    of protected modules are collected again at each `refresh` (the start of each iteration),
    because parameters can be re-allocated between iterations (``module.to``, resharding).
    """

    def __init__(self, *, min_offload_bytes: int, device_type: str) -> None:
        self.min_offload_bytes = min_offload_bytes
        self.device_type = device_type
        self._modules: list[nn.Module] = []
        self._module_ids: set[int] = set()
        # storage key -> the storage itself: holding it keeps the key from being reused by
        # another allocation while it is in the set (a buffer that a module replaces in forward
        # would otherwise free its address, and a new activation there would look protected).
        self._protected: dict[int, torch.UntypedStorage] = {}
        # torch.device -> whether it is of `device_type` (reading ``device.type`` costs more
        # than the rest of the checks together; a pack hook runs for every saved tensor).
        self._on_device: dict[torch.device, bool] = {}

    def protect(self, module: nn.Module) -> None:
        """Never offload the parameters and buffers of ``module`` (recursively), or their views."""
        if id(module) not in self._module_ids:
            self._module_ids.add(id(module))
            self._modules.append(module)
        self._add_storages(module, set())

    def refresh(self) -> None:
        """Collect the protected storages anew.

        Each module is visited once however many protected modules contain it (the model
        chunk and every offloaded submodule of it are all protected): one pass over the tree.
        """
        self._protected = {}
        visited: set[int] = set()
        for module in self._modules:
            self._add_storages(module, visited)

    def _add_storages(self, module: nn.Module, visited: set[int]) -> None:
        # A walk over the ``_modules`` dicts rather than `nn.Module.modules`, which builds every
        # submodule's dotted name: this runs over the whole model at each iteration's start.
        stack = [module]
        protected = self._protected
        while stack:
            sub = stack.pop()
            if sub is None or id(sub) in visited:
                continue
            visited.add(id(sub))
            stack += sub._modules.values()
            for tensor in (*sub._parameters.values(), *sub._buffers.values()):
                if tensor is None:
                    continue
                plains = (tensor,) if type(tensor) in _PLAIN_TYPES else _plain_tensors(tensor)
                for plain in plains:
                    if plain.layout == torch.strided and not plain.is_meta and plain.numel() > 0:
                        storage = plain.untyped_storage()
                        protected[key_of_storage(storage)] = storage

    def should_offload(self, tensor: torch.Tensor, activations: frozenset[int] = frozenset()) -> bool:
        """True for a large strided activation on the offload device that is not protected.

        ``activations``: storages known to be activations (the group's leaf inputs), to which
        the leaf-requires-grad rule does not apply.
        """
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
            return False  # parameters, subclasses (DTensor, fake, functional) and sparse tensors
        device = tensor.device
        on_device = self._on_device.get(device)
        if on_device is None:
            on_device = self._on_device[device] = device.type == self.device_type
        if not on_device:
            return False
        if tensor.nbytes < self.min_offload_bytes:  # numel * element_size
            return False
        storage_obj = tensor.untyped_storage()
        storage = key_of_storage(storage_obj)
        if storage in self._protected:
            return False
        if storage not in activations:
            base = view_base(tensor)
            if base is None:
                if tensor.is_leaf and tensor.requires_grad:
                    return False  # a leaf that requires grad is a parameter in all but type
            # (a view made without grad mode, e.g. in a custom Function's forward, also reports
            # is_leaf and requires_grad; its base decides)
            elif isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
                return False
        return not _marked(tensor, storage_obj)
