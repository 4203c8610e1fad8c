"""Every private torch call the engine makes, in one place, so a torch upgrade edits one file.

- `storage_key` / `key_of_storage`: the identity of a tensor's storage (its ``StorageImpl``), shared
  by all views;
- `view_base`: the tensor a view was made from (``Tensor._base``), or None;
- `top_saved_tensors_hooks`: the innermost active saved-tensor hooks (a private autograd API);
- `is_wrapper_subclass`: whether a tensor wraps inner tensors (DTensor), from torch's dispatch utils;
- `tree_flatten`: torch's pytree utility (a module's output as dicts, nested
  tuples, namedtuples, registered dataclass-like outputs such as HF ``ModelOutput``).
"""

from __future__ import annotations

import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "is_wrapper_subclass",
    "key_of_storage",
    "storage_key",
    "top_saved_tensors_hooks",
    "tree_flatten",
    "view_base",
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


def top_saved_tensors_hooks():
    """The innermost active default saved-tensor hooks as ``(pack, unpack)``, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def is_wrapper_subclass(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a wrapper subclass (DTensor, ...) whose data lives in inner tensors."""
    return is_traceable_wrapper_subclass(tensor)


def tree_flatten(tree) -> tuple[list, object]:
    """The leaves of ``tree`` (torch's pytree order) and its spec."""
    return _pytree.tree_flatten(tree)
