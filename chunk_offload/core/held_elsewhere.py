"""`HeldElsewhere`: the places of saved storages that another reference keeps on the device.

NOTE [Storages held elsewhere]
Copying a saved storage to host lowers device memory only if its group held the last
reference to it. Others may hold it too: autograd, for an op outside every offload group that
saved the same storage (core attention's output is the saved input of the projection after
it), the schedule (a chunk's received input stays alive until its backward), or user code.
Such a copy costs link time and frees nothing, and counting it as moved made the theory
promise a drop the device never showed.

At the end of a chunk's forward every local of that forward is gone, so a copied storage
whose memory outlived its group's release (`_torch_compat.storage_expired` on a weak handle
taken at the copy) is held elsewhere. Its place, (virtual stage, group index in the chunk,
storage ordinal in the group; the group's name too), is noted here; groups at that place of later chunks keep the
storage on device, uncopied and out of the saved-bytes accounting, which counts only what
offload can move (`OffloadGroup.commit`). The chunk that learned it reloads its host copy in
backward as usual, so results stay exact. Whatever still references a copied storage when the
chunk's forward ends counts, the chunk's own output too when a group saved it and the caller
frees it only later (megatron frees a sent output after the chunk's forward hook).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from ._torch_compat import free_weak_storage, storage_expired

if TYPE_CHECKING:
    from .saved import Storage

__all__ = ["HeldElsewhere"]


class HeldElsewhere:
    """Storage places (vp stage, group index and name, ordinal) learned to be held by another reference."""

    __slots__ = ("_places",)

    def __init__(self) -> None:
        self._places: dict[tuple[int, int, str], set[int]] = {}

    def kept(self, vp_stage: int, group_index: int, name: str) -> set[int] | None:
        """Ordinals of the storages to keep on device in group ``group_index`` (named ``name``) of a
        ``vp_stage`` chunk; None: none."""
        return self._places.get((vp_stage, group_index, name))

    def note(self, vp_stage: int, group_index: int, name: str, ordinal: int) -> None:
        """Storage ``ordinal`` of that group was copied, and another reference kept its memory alive."""
        places = self._places.get((vp_stage, group_index, name))
        if places is None:
            places = self._places[(vp_stage, group_index, name)] = set()
        places.add(ordinal)

    def learn(self, vp_stage: int, group_index: int, name: str, storages: Iterable["Storage"]) -> int:
        """Check the weak handles the copies of one group's ``storages`` took; note the places of
        those still alive. Returns their bytes (copied for nothing)."""
        nbytes = 0
        for ordinal, storage in enumerate(storages):
            weak = storage.weak
            if weak is None:
                continue
            storage.weak = None
            if not storage_expired(weak):
                self.note(vp_stage, group_index, name, ordinal)
                nbytes += storage.nbytes
            free_weak_storage(weak)
        return nbytes

    def clear(self) -> None:
        """Forget every place (the offloaded modules changed)."""
        self._places.clear()

    def __len__(self) -> int:
        return sum(len(places) for places in self._places.values())
