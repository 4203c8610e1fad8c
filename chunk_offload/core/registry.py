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

    def add(self, manager: HandlerSource, module: nn.Module, name: str, layer: nn.Module | None, *, by_layer: bool) -> ModuleOffload:
        """Register ``module`` as group ``name`` (`OffloadManager.offload_module`), joining ``layer``'s
        group where ``by_layer`` (NOTE [Layer groups] in marks.py); refuse a second registration."""
        check_module("offload_module", module)
        if layer is not None and not isinstance(layer, nn.Module):
            raise ChunkOffloadError(f"offload_module(layer=...) needs an nn.Module or None, got {type(layer).__name__}")
        if not isinstance(name, str) or not name:
            raise ChunkOffloadError(f"offload_module needs a non-empty group name, got {name!r}")
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
            held_elsewhere.clear()

        registration = ModuleOffload(manager, module, name, marks=self._marks, on_remove=removed, layer=layer if by_layer else None)
        registrations.append(registration)
        held_elsewhere.clear()
        return registration
