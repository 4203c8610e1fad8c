"""The storages of protected module trees, collected again at each iteration's start, cheaply.

`TensorFilter` never offloads a tensor on the storage of a protected module's parameter or
buffer. Parameters can be re-allocated between iterations (``module.to``, resharding), so the
storages are collected again at each iteration's start; but a model seldom changes, so
`ProtectedStorages.refresh` first checks that the module trees and their tensors are still
those of the last collection, in a few passes over cached lists that run in C (``map``), and
walks and collects again only when something changed. See NOTE [Exact refresh].
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain, filterfalse
from operator import is_, itemgetter, methodcaller

import torch
from torch import nn

from ._torch_compat import is_wrapper_subclass, key_of_storage

__all__ = ["ProtectedStorages"]

# NOTE [Exact refresh]
# The protected storages are a function of (1) the modules reachable from the protected roots
# through ``_modules``, (2) the objects in those modules' ``_parameters`` and ``_buffers`` and
# (3) for each plain tensor among them its layout, device, numel and storage. The check at
# each refresh proves all three unchanged since the last collection. It holds every dict,
# tensor and storage of that collection, so no object it compares by identity can have been
# freed and its address (its ``id``, a storage's key) reused.
# (1)+(2) each module's ``_modules``, ``_parameters`` and ``_buffers`` attributes are the same
#     dict objects, read from its ``__dict__``; the dicts that were empty still are; the
#     others have the same sizes and, concatenated, the same values (by identity). So each
#     module has the same children and tensors, and a walk from the same roots reaches the
#     same modules. Reading the dicts sees every change: ``setattr``, ``add_module``,
#     ``register_*`` (which torch's global registration hooks would see too) and what those
#     hooks miss: ``ModuleList.insert`` (writes ``_modules[...]`` directly), ``del seq[0]``
#     (rebinds ``_modules``), ``delattr``, any direct write (``_parameters[name] = p``) or
#     rebinding. Hence no hooks (process-global state for nothing). Not seen: a module's
#     ``__dict__`` itself rebound, which torch does only to modules it is building (copies,
#     replicas) and to ScriptModules, whose dicts are not dicts: trees with one of those are
#     walked at every refresh.
# (3) a "checked" tensor (not a wrapper subclass, strided, not meta, not empty: the ones whose
#     storage is collected) has the same storage object and is still not empty. The same
#     Python storage object is the same StorageImpl, i.e. the same key (while a StorageImpl
#     lives it keeps its Python object, so an unchanged storage compares equal; a new Python
#     object for it would only cost a collection). A new storage is seen whatever made it:
#     ``p.data = new``, ``module.to(dtype)`` (same Parameter objects, ``.data`` assigned),
#     ``set_``, ``torch.utils.swap_tensors``. ``storage.resize_`` keeps the StorageImpl: key
#     and decision unchanged. Meta or not is the storage's device, and a tensor's layout never
#     changes (``.data =`` refuses a tensor of another layout).
# Every other tensor (wrapper subclasses such as DTensor, whose inner tensors can be replaced
# without a trace in the module; sparse, meta or empty ones) is re-examined at each refresh.
# What a failed check costs: a change of the modules (1) walks the trees again; a change of
# tensors only (a buffer replaced in forward, ``p.data = new``) re-collects the tensors of the
# same dicts, without a walk.

_DICT_TYPES = frozenset((dict, OrderedDict))  # a module's three dicts (OrderedDict after `del seq[i]`): `_VALUES` reads them
_VALUES = dict.values
_ANY_VALUES = methodcaller("values")
_THREE_DICTS = itemgetter(1, 2, 3)
_PLAIN_TYPES = (torch.Tensor, nn.Parameter, nn.Buffer)  # not wrapper subclasses, known without asking
_STORAGE = torch.Tensor.untyped_storage
_NUMEL = torch.Tensor.numel


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


def _collected(plain: torch.Tensor) -> bool:
    """Whether the storage of plain tensor ``plain`` is protected (a sparse, meta or empty one has none worth holding)."""
    return plain.layout is torch.strided and not plain.is_meta and plain.numel() != 0


def _attributes(module: nn.Module) -> tuple:
    """``module.__dict__`` and the ``_modules``, ``_parameters`` and ``_buffers`` in it.

    Read from the ``__dict__``: ``nn.Module`` defines ``__getattr__``, which puts every attribute
    read on the interpreter's slow path (twice the time of the check here).
    """
    attributes = module.__dict__
    try:
        return attributes, attributes["_modules"], attributes["_parameters"], attributes["_buffers"]
    except KeyError:  # not in the instance dict: never checked, walked again at each refresh
        return attributes, module._modules, module._parameters, module._buffers


def _walk(roots: list[nn.Module]) -> list[tuple]:
    """`_attributes` of every module of the trees of ``roots``, each once (the model chunk and
    every offloaded submodule of it are all roots). A walk over the ``_modules`` dicts rather
    than `nn.Module.modules`, which builds every submodule's dotted name."""
    entries: list[tuple] = []
    visited: set[int] = set()
    stack = list(reversed(roots))
    while stack:
        sub = stack.pop()
        if sub is None or (key := id(sub)) in visited:
            continue
        visited.add(key)
        entry = _attributes(sub)
        entries.append(entry)
        if entry[1]:
            stack.extend(entry[1].values())
    return entries


class _Snapshot:
    """One collection, and what the check of NOTE [Exact refresh] compares with it."""

    __slots__ = (
        "entries", "checkable", "empty", "filled", "sizes", "module_dicts", "children", "tensor_dicts", "tensors",
        "checked", "storages", "others", "by_key",
    )  # fmt: skip

    def __init__(self, roots: list[nn.Module]) -> None:
        self.entries = _walk(roots)
        dicts = list(chain.from_iterable(map(_THREE_DICTS, self.entries)))  # per module: modules, parameters, buffers
        self.checkable = set(map(type, dicts)) <= _DICT_TYPES  # see NOTE [Exact refresh] (ScriptModules)
        self.module_dicts = list(filter(None, dicts[0::3]))
        self.tensor_dicts = list(filter(None, chain(dicts[1::3], dicts[2::3])))
        self.empty = list(filterfalse(None, dicts))
        self.filled = self.module_dicts + self.tensor_dicts
        self.sizes = list(map(len, self.filled))
        self.children = list(chain.from_iterable(map(_ANY_VALUES, self.module_dicts)))
        self.collect(list(chain.from_iterable(map(_ANY_VALUES, self.tensor_dicts))))

    def collect(self, tensors: list) -> None:
        """Sort ``tensors`` (the values of the modules' parameter and buffer dicts, None included)
        and collect their storages."""
        self.tensors = tensors
        self.checked: list[torch.Tensor] = []
        self.others: list[torch.Tensor] = []
        for tensor in tensors:
            if tensor is None:
                continue
            if (
                (type(tensor) in _PLAIN_TYPES or not is_wrapper_subclass(tensor))
                and tensor.layout is torch.strided
                and not tensor.is_meta
                and tensor.numel()
            ):
                self.checked.append(tensor)
            else:
                self.others.append(tensor)
        self.storages = list(map(_STORAGE, self.checked))
        self.by_key = dict(zip(map(key_of_storage, self.storages), self.storages))

    def same_modules(self) -> bool:
        """Whether the modules have the same children, and the same dicts of tensors with the same
        sizes (part 1 of NOTE [Exact refresh]; the tensors in those dicts are `tensors_now`)."""
        if not self.checkable:
            return False
        try:
            for attributes, modules, parameters, buffers in self.entries:
                if (
                    attributes["_modules"] is not modules
                    or attributes["_parameters"] is not parameters
                    or attributes["_buffers"] is not buffers
                ):
                    return False
        except KeyError:  # an attribute deleted: the walk will say how it fails
            return False
        if any(self.empty) or list(map(len, self.filled)) != self.sizes:
            return False
        return all(map(is_, chain.from_iterable(map(_VALUES, self.module_dicts)), self.children))

    def same_tensors(self) -> bool:
        """Whether the parameter and buffer dicts hold the same tensors (part 2; when `same_modules`,
        which proved them the same dicts with the same sizes)."""
        return all(map(is_, chain.from_iterable(map(_VALUES, self.tensor_dicts)), self.tensors))

    def tensors_now(self) -> list:
        """The values of the parameter and buffer dicts now (when `same_modules`)."""
        return list(chain.from_iterable(map(_VALUES, self.tensor_dicts)))

    def same_storages(self) -> bool:
        """Whether the checked tensors are on the same storages and still not empty (part 3)."""
        return all(map(is_, map(_STORAGE, self.checked), self.storages)) and all(map(_NUMEL, self.checked))

    def storages_now(self) -> dict[int, torch.UntypedStorage]:
        """The protected storages by key: the checked tensors' and the others' as they are now."""
        if not self.others:
            return self.by_key
        by_key = dict(self.by_key)
        for tensor in self.others:
            for plain in _plain_tensors(tensor):
                if _collected(plain):
                    storage = plain.untyped_storage()
                    by_key[key_of_storage(storage)] = storage
        return by_key


class ProtectedStorages:
    """The storages of the parameters and buffers of protected module trees, by storage key.

    The storages themselves are held: that keeps a key from being reused by another allocation
    while it is listed (a buffer that a module replaces in forward would otherwise free its
    address, and a new activation there would look protected). A storage no module has any
    more is dropped at the next `refresh`, and so is a module taken out of a tree.
    """

    def __init__(self) -> None:
        self._roots: list[nn.Module] = []
        self._root_ids: set[int] = set()
        self._snapshot: _Snapshot | None = None
        self.by_key: dict[int, torch.UntypedStorage] = {}
        """Storage key -> storage, as of the last `refresh` and the `add` calls since."""

    def add(self, module: nn.Module) -> None:
        """Protect the parameters and buffers of ``module`` (recursively), from now on."""
        if id(module) not in self._root_ids:
            self._root_ids.add(id(module))
            self._roots.append(module)
        if self._snapshot is not None:
            self._snapshot = None  # the trees are walked again at the next refresh
            self.by_key = dict(self.by_key)  # not the snapshot's dict any more: updated in place below
        self.by_key.update(_Snapshot([module]).storages_now())

    def refresh(self) -> dict[int, torch.UntypedStorage]:
        """Collect the protected storages anew (`by_key`, returned too); exactly what a walk and a
        collection would give, at the cost of a check when nothing changed (NOTE [Exact refresh])."""
        snapshot = self._snapshot
        if snapshot is None or not snapshot.same_modules():
            snapshot = self._snapshot = _Snapshot(self._roots)
        elif not snapshot.same_tensors():  # a buffer replaced in forward (MoE routers): no walk
            snapshot.collect(snapshot.tensors_now())
        elif not snapshot.same_storages():
            snapshot.collect(snapshot.tensors)
        self.by_key = snapshot.storages_now()
        return self.by_key
