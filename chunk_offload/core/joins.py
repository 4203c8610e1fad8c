"""`CallJoins`: which group a module call collects into where calls join (NOTE [Layer groups],
NOTE [Bounded layer groups] and NOTE [Joined calls] in marks.py): the group pending for its layer's
next call, and a join that holds only if the joining call saves a storage of that group."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Callable, Collection, Sequence

import torch

from .saved import alive

if TYPE_CHECKING:
    from .group import OffloadGroup

__all__ = ["CallJoins", "copy_bytes", "joins_layer_group"]

Undone = tuple[str, Sequence[torch.Tensor], Collection]
"""A joined call's name, inputs and input nodes, for the group of its own it opens instead."""
Commit = Callable[["OffloadGroup"], None]
"""The handler's commit of a group no call joins any more."""


def joins_layer_group(copy_bytes: int, bound: int | None) -> bool:
    """Whether a layer's next call joins its pending group, which holds ``copy_bytes`` to copy, under
    `OffloadConfig.layer_group_bytes` ``bound`` (NOTE [Bounded layer groups] in marks.py). The one
    rule: the engine's `CallJoins` and the planner's layer groups both ask it."""
    return bound is None or copy_bytes < bound


class CallJoins:
    """A chunk's pending group (committed through the handler's ``commit`` once no call joins it) and
    tentative join. The methods that may commit take ``commit``: a stored callback of the handler would
    make a cycle (NOTE [No cycles per iteration] in handler.py)."""

    __slots__ = ("_pending", "_layer", "_bound", "tentative")

    def __init__(self, bound: int | None = None) -> None:
        self._pending: OffloadGroup | None = None
        self._bound = bound  # `OffloadConfig.layer_group_bytes`
        self._layer: object = None
        self.tentative: tuple[OffloadGroup, str, str, Sequence[torch.Tensor], set[int]] | None = None
        """Set while the open call joined on condition and has copied nothing yet: the group it
        joined, that group's name, member and inputs before, and the storages it held then."""

    def join(
        self, name: str, inputs: Sequence[torch.Tensor], layer: object, if_shared: bool, commit: Commit, joiner_of: str | None = None
    ) -> "OffloadGroup | None":
        """The pending group, which call ``name`` of ``layer`` joins (tentatively where ``if_shared``);
        None once the pending group, if any, is committed: the call opens a group of its own.
        ``joiner_of``: the module whose group the call's module is registered to join (``joins``)."""
        pending = self._pending
        if pending is None:
            return None
        joins = layer is not None and layer is self._layer
        self._pending = self._layer = None
        if joins and self._bound is not None and not joins_layer_group(copy_bytes(pending), self._bound):
            # Past the bound only the joiner of the call before joins, on condition (NOTE [Bounded layer groups] in marks.py).
            joins = if_shared = joiner_of is not None and joiner_of == pending.member
        if not joins:
            commit(pending)
            return None
        if if_shared:
            self.tentative = (pending, pending.name, pending.member, pending.inputs, set(pending.storages))
        pending.join(name, inputs)
        return pending

    def leave_pending(self, group: "OffloadGroup", layer: object) -> None:
        """``group``'s call ended: the next call of ``layer`` may join it."""
        self._pending, self._layer = group, layer

    def commit_pending(self, commit: Commit) -> None:
        """Commit the pending group, if any: no further call joins it."""
        pending = self._pending
        if pending is not None:
            self._pending = self._layer = None
            commit(pending)

    def settle(self, first_key: int | None, commit: Commit) -> Undone | None:
        """The tentatively joined call's first tensor to copy views storage ``first_key`` (None: it
        copies nothing). None if its group held that storage before the join: the join holds. Else
        the join is undone, the group committed as it was, and the call's name, inputs and input
        nodes returned (tensors it kept on device so far stay counted in the group it joined)."""
        group, name, member, inputs, keys = self.tentative
        self.tentative = None
        if first_key is not None and first_key in keys:
            return None
        undone = (group.member, group.inputs, group.input_nodes)
        group.name, group.member, group.inputs, group.input_nodes = name, member, inputs, ()
        commit(group)
        return undone

    def clear(self) -> None:
        """Forget the pending group and the tentative join (the chunk was aborted)."""
        self._pending = self._layer = self.tentative = None


def copy_bytes(group: "OffloadGroup") -> int:
    """What a collecting ``group`` holds to copy: each storage's first live saved view's bytes, read at
    the first join after it was saved (the originals are held until commit), each storage counted once
    (`OffloadGroup.copy_bytes` and ``copy_counted``: a layer's joins walk its storages once in all)."""
    storages = group.storages
    if len(storages) > group.copy_counted:
        for storage in itertools.islice(storages.values(), group.copy_counted, None):
            refs = alive(storage)
            if refs:
                group.copy_bytes += refs[0].tensor.nbytes
        group.copy_counted = len(storages)
    return group.copy_bytes
