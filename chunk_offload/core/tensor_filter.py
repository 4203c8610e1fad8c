"""What may be offloaded: large activations only, never parameters, buffers or their views."""

from __future__ import annotations

from operator import attrgetter
from typing import Callable, Sequence

import torch
from torch import nn

from ._torch_compat import key_of_storage, storage_key, view_base
from .errors import ChunkOffloadError
from .protected_storages import ProtectedStorages

__all__ = ["TensorFilter", "mark_not_offloadable", "is_marked_not_offloadable"]

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


_NOT_OFFLOADABLE = (False, 0)
"""`TensorFilter.decide` for a tensor no saved view of whose storage is offloaded (one tuple, made once)."""


class TensorFilter:
    """Decides per saved tensor whether it is offloaded.

    Parameters and buffers are recognised by *storage*, not by type: ``weight.t()`` is a plain
    tensor but shares the weight's storage, and copying it out would free nothing. The storages
    of protected modules are collected again at each `refresh` (the start of each iteration),
    because parameters can be re-allocated between iterations (``module.to``, resharding).
    """

    def __init__(self, *, min_offload_bytes: int, device_type: str) -> None:
        self.min_offload_bytes = min_offload_bytes
        self.device_type = device_type
        self._storages = ProtectedStorages()
        # storage key -> the storage itself (`ProtectedStorages.by_key`): holding it keeps the key
        # from being reused by another allocation while it is in the set.
        self._protected: dict[int, torch.UntypedStorage] = self._storages.by_key
        self._on_device = self._device_check(device_type)

    def protect(self, module: nn.Module) -> None:
        """Never offload the parameters and buffers of ``module`` (recursively), or their views."""
        self._storages.add(module)
        self._protected = self._storages.by_key

    def forget_protected(self) -> None:
        """Drop every protected module and storage (the manager closed): a closed manager must not
        keep the user's model, or its parameters' device memory, alive."""
        self._storages = ProtectedStorages()
        self._protected = self._storages.by_key

    def refresh(self) -> None:
        """Collect the protected storages anew: exactly what a walk over every protected module
        tree would collect, at the cost of a check of the cached trees when none changed
        (NOTE [Exact refresh] in `protected_storages.py`)."""
        self._protected = self._storages.refresh()

    def should_offload(self, tensor: torch.Tensor, inputs: Sequence[torch.Tensor] = ()) -> bool:
        """True for a large strided activation on the offload device that is not protected.

        ``inputs``: the group's input tensors; leaves among them that require grad (or views of
        one) are activations handed to the group, to which the leaf-requires-grad rule does not apply.
        """
        return self.decide(tensor, inputs)[0]

    def decide(self, tensor: torch.Tensor, inputs: Sequence[torch.Tensor] = ()) -> tuple[bool, int]:
        """`should_offload` with the storage key of ``tensor`` (`storage_key`): ``(offload, key)``.

        - ``(True, key)``: offloaded;
        - ``(False, key)``: kept on device (too small, marked, a leaf), and ``key`` is that of a
          storage another saved view may share: the group keeps such views too (`OffloadGroup.keep`);
        - ``(False, 0)``: kept, and no saved view of its storage can be offloaded (not a plain
          strided tensor, on another device, or a protected storage).

        The pack hook runs this for every saved tensor: the cheap refusals come first and the
        storage is looked up once, for the decision and the group's bookkeeping alike.
        """
        if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
            return _NOT_OFFLOADABLE  # parameters, subclasses (DTensor, fake, functional) and sparse tensors
        if not self._on_device(tensor):
            return _NOT_OFFLOADABLE
        storage_obj = tensor.untyped_storage()
        key = key_of_storage(storage_obj)
        if key in self._protected:
            return _NOT_OFFLOADABLE
        if tensor.nbytes < self.min_offload_bytes:  # numel * element_size
            return False, key
        base = view_base(tensor)
        if base is None:
            # A leaf that requires grad is a parameter in all but type (unless the group was handed it).
            if tensor.is_leaf and tensor.requires_grad and not _is_leaf_input(key, inputs):
                return False, key
        # (a view made without grad mode, e.g. in a custom Function's forward, also reports
        # is_leaf and requires_grad; its base decides)
        elif (isinstance(base, nn.Parameter) or (base.requires_grad and base.is_leaf)) and not _is_leaf_input(key, inputs):
            return False, key
        if tensor.__dict__ or (base is not None and base.__dict__) or getattr(storage_obj, _KEEP_ATTR, False):
            if _marked(tensor, storage_obj):  # only a tensor or storage with attributes can carry a mark
                return False, key
        return True, key

    def _device_check(self, device_type: str) -> Callable[[torch.Tensor], bool]:
        """Whether a tensor is on ``device_type``: a flag read for cpu and cuda (``tensor.device``
        builds a device object per call), the device's type otherwise."""
        if device_type == "cuda":
            return attrgetter("is_cuda")
        if device_type == "cpu":
            return attrgetter("is_cpu")
        return lambda tensor: tensor.device.type == device_type


def _is_leaf_input(key: int, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether storage ``key`` is that of a group input that is a plain leaf requiring grad (or a
    view of one): an activation handed to the group (a pipeline stage's received input, a detached
    chunk input), not a parameter, so the leaf rule must not keep it."""
    for t in inputs:
        root = view_base(t)
        if root is None:
            root = t
        if (
            type(root) is torch.Tensor
            and root.is_leaf
            and root.requires_grad
            and t.layout is torch.strided
            and storage_key(t) == key
        ):
            return True
    return False
