"""Every private torch call the engine makes, in one place, so a torch upgrade edits one file.

- `storage_key` / `key_of_storage`: the identity of a tensor's storage (its ``StorageImpl``), shared
  by all views;
- `view_base`: the tensor a view was made from (``Tensor._base``), or None;
- `top_saved_tensors_hooks`: the innermost active saved-tensor hooks (a private autograd API);
- `push_saved_tensors_hooks` / `pop_saved_tensors_hooks`: what `saved_tensors_hooks`'s enter and
  exit call, without a context object per group;
- `is_wrapper_subclass`: whether a tensor wraps inner tensors (DTensor), from torch's dispatch utils;
- `add_gradient_hook`: `Tensor.register_hook` without its removable handle;
- `weak_storage` / `storage_expired` / `free_weak_storage`: a weak handle on a tensor's storage
  (what CUDA-graph trees use), to learn whether releasing our references freed its memory;
- `current_stream_data` / `set_stream_data`: the current CUDA stream as the ``(stream_id,
  device_index, device_type)`` triple torch keeps, read and set without building a
  ``torch.cuda.Stream`` (NOTE [CUDA host path] in streams/cuda.py);
- `tree_flatten`: torch's pytree utility (a module's output as dicts, nested
  tuples, namedtuples, registered dataclass-like outputs such as HF ``ModelOutput``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "add_gradient_hook",
    "is_wrapper_subclass",
    "key_of_storage",
    "pop_saved_tensors_hooks",
    "push_saved_tensors_hooks",
    "storage_key",
    "top_saved_tensors_hooks",
    "tree_flatten",
    "view_base",
    "weak_storage",
    "storage_expired",
    "free_weak_storage",
    "storage_use_count",
    "current_stream_data",
    "set_stream_data",
]


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage: equal for every view of it, unique while it lives.

    Callers keep the storage (or a tensor on it) alive for as long as they keep the key, so
    that the key cannot be reused by another allocation.
    """
    return tensor.untyped_storage()._cdata


def key_of_storage(storage: torch.UntypedStorage) -> int:
    """`storage_key` of a tensor whose ``untyped_storage()`` is ``storage``."""
    return storage._cdata


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of (autograd's ``_base``); None if it is not a view."""
    return tensor._base


def push_saved_tensors_hooks(pack, unpack) -> None:
    """Make ``pack``/``unpack`` the innermost default saved-tensor hooks (`saved_tensors_hooks.__enter__`)."""
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def pop_saved_tensors_hooks() -> None:
    """Remove the innermost default saved-tensor hooks (`saved_tensors_hooks.__exit__`)."""
    torch._C._autograd._pop_saved_tensors_default_hooks()


def top_saved_tensors_hooks():
    """The innermost active default saved-tensor hooks as ``(pack, unpack)``, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


# The key of our hook in a tensor's ``_backward_hooks`` dict: `torch.utils.hooks.RemovableHandle`
# ids, the keys `Tensor.register_hook` adds, are ints, so a later user hook never replaces it.
_HOOK_KEY = "chunk_offload"


def add_gradient_hook(tensor: torch.Tensor, hook) -> None:
    """Run ``hook(grad)`` when the gradient of non-leaf ``tensor`` is complete, as
    ``tensor.register_hook(hook)`` does, for a hook that is never removed (it lives as long as
    the graph). `Tensor.register_hook` builds a removable handle and imports a module on every
    call, several times the cost of what it registers; a plain tensor whose hook dict is still
    empty gets the same registration directly (the dict, and its node reading it)."""
    if type(tensor) is not torch.Tensor or tensor._backward_hooks is not None:
        tensor.register_hook(hook)  # subclasses (torch function handling), or hooks already there
        return
    tensor._backward_hooks = OrderedDict(((_HOOK_KEY, hook),))  # a user's handle holds it weakly: not a plain dict
    tensor.grad_fn._register_hook_dict(tensor)


def is_wrapper_subclass(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a wrapper subclass (DTensor, ...) whose data lives in inner tensors."""
    return is_traceable_wrapper_subclass(tensor)


def tree_flatten(tree) -> tuple[list, object]:
    """The leaves of ``tree`` (torch's pytree order) and its spec."""
    return _pytree.tree_flatten(tree)


def weak_storage(tensor: torch.Tensor) -> int:
    """A weak handle on ``tensor``'s storage: it does not keep the memory alive. Free it with
    `free_weak_storage` exactly once."""
    return tensor.untyped_storage()._weak_ref()


def storage_expired(handle: int) -> bool:
    """Whether the storage behind ``handle`` was freed (every strong reference is gone)."""
    return torch.UntypedStorage._expired(handle)


def storage_use_count(tensor: torch.Tensor) -> int:
    """How many strong references ``tensor``'s storage has (tensors on it, storage objects), the
    tensor's own included and the storage object this call makes excluded."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) - 1


def free_weak_storage(handle: int) -> None:
    """Drop a handle made by `weak_storage`."""
    torch.UntypedStorage._free_weak_ref(handle)


def current_stream_data(device_index: int) -> tuple[int, int, int]:
    """``(stream_id, device_index, device_type)`` of the current CUDA stream of ``device_index``
    (what `torch.cuda.current_stream` reads before it builds its Stream object)."""
    return torch._C._cuda_getCurrentStream(device_index)


def set_stream_data(data: tuple[int, int, int]) -> None:
    """Make the stream ``data`` (`current_stream_data`'s triple) current (what `torch.cuda.set_stream` calls)."""
    torch._C._cuda_setStream(stream_id=data[0], device_index=data[1], device_type=data[2])
