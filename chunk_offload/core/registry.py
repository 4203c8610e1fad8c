"""`ModuleRegistry`: the modules one manager offloads, each registered once as one named group."""

from __future__ import annotations

from torch import nn

from .errors import ChunkOffloadError
from .held_elsewhere import HeldElsewhere
from .manager_args import check_module
from .marks import GroupMarks, HandlerSource, ModuleOffload

__all__ = ["ModuleRegistry"]


class ModuleRegistry:
    """The `ModuleOffload` registrations of a manager not removed yet, in registration order.

    A change of the registered modules changes the groups' indices within a chunk, so what was
    learned per index (NOTE [Storages held elsewhere]) is forgotten.
    """

    def __init__(self, marks: GroupMarks, held_elsewhere: HeldElsewhere) -> None:
        self._marks = marks
        self._held_elsewhere = held_elsewhere
        self.registrations: list[ModuleOffload] = []

    def add(
        self, manager: HandlerSource, module: nn.Module, name: str, layer: nn.Module | None, *, group_by: str, joins: str | None = None
    ) -> ModuleOffload:
        """Register ``module`` as group ``name`` (`OffloadManager.offload_module`), joining ``layer``'s
        group where ``group_by`` is "layer" (NOTE [Layer groups] in marks.py), or, where it is "module",
        the pending group of module ``joins`` of ``layer`` (NOTE [Joined calls]); refuse a second registration."""
        check_module("offload_module", module)
        if layer is not None and not isinstance(layer, nn.Module):
            raise ChunkOffloadError(f"offload_module(layer=...) needs an nn.Module or None, got {type(layer).__name__}")
        if not isinstance(name, str) or not name:
            raise ChunkOffloadError(f"offload_module needs a non-empty group name, got {name!r}")
        if joins is not None and (not isinstance(joins, str) or not joins or layer is None or joins == name):
            raise ChunkOffloadError(
                f"offload_module(joins=...) needs the name of another module of the same layer (a non-empty str other "
                f"than {name!r}) and layer=..., got joins={joins!r}, layer={type(layer).__name__ if layer is not None else None}"
            )
        for existing in self.registrations:
            if existing.module is module:
                raise ChunkOffloadError(
                    f"offload_module: this {type(module).__name__} is already offloaded as group "
                    f"{existing.name!r}; cannot register it again as {name!r} (one group per module: "
                    "remove() the first registration, or offload a parent or child module instead)"
                )
        registrations, held_elsewhere = self.registrations, self._held_elsewhere

        def removed(registration: ModuleOffload) -> None:  # holds no manager: its hooks must not keep it alive
            registrations.remove(registration)
            _link_joins(registrations, group_by)
            held_elsewhere.clear()

        registration = ModuleOffload(manager, module, name, marks=self._marks, on_remove=removed, layer=layer, joins=joins)
        registrations.append(registration)
        _link_joins(registrations, group_by)
        held_elsewhere.clear()
        return registration

    def remove_all(self) -> None:
        """Remove every registration's hooks (`OffloadManager.close`): the registry holds no module after."""
        for registration in list(self.registrations):
            registration.remove()


def _link_joins(registrations: list[ModuleOffload], group_by: str) -> None:
    """Set what each registration's calls pass at their start and end (NOTE [Layer groups] and
    NOTE [Joined calls] in marks.py). "layer": its layer both times. "module": its layer at the
    start where it joins another module's group (if it saves a storage of it), and at the end where
    another module joins its own. "call": nothing, every call is its own group."""
    joined = {(id(r.layer), r.joins) for r in registrations if r.joins is not None} if group_by == "module" else set()
    for r in registrations:
        if group_by == "layer":
            r.open_layer = r.commit_layer = r.layer
        else:
            r.open_layer = r.layer if (id(r.layer), r.joins) in joined else None
            r.commit_layer = r.layer if r.layer is not None and (id(r.layer), r.name) in joined else None
        r.if_shared = r.open_layer is not None and group_by == "module"
