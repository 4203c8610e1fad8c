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

A baseline iteration copies nothing, so nothing would be learned before the first iteration that
copies: a device budget chosen from the baseline's bytes then counted on drops no copy makes, and
each iteration learned more places (README's 600 KiB job: 627712 bytes measured against 611328
predicted on its first budgeted iteration). So the chunks of the first baseline iteration are
probed without a copy (`probe`): at the forward's end each saved original the groups hold is
swapped for a detached alias of it (same storage and version counter, no view base, so it keeps
nothing else alive), and a storage with more strong references than the chunk's aliases of it is
held elsewhere, the answer the weak handle gives after a copy of every group. Both ways the
places learned in a chunk are reported with it (`IterationRecord.group_learned_bytes`): later
chunks at those places keep the storage, so a budget counts it kept in every chunk.

Two groups of a chunk may save one storage (core attention's output, saved by core_attn and by
attn_proj): copying one of them frees nothing while the other holds it on device, and the copy
would then be learned as held elsewhere. `shared_groups` names such groups per chunk
(`IterationRecord.group_shared`), and a device budget copies them together or not at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Protocol, Sequence

from ._torch_compat import free_weak_storage, storage_expired, storage_use_count

if TYPE_CHECKING:
    from .saved import Storage

__all__ = ["HeldElsewhere", "ProbedGroup"]


class ProbedGroup(Protocol):
    """What `HeldElsewhere.probe` and `shared_groups` read of a committed group (an `OffloadGroup`)."""

    index: int
    name: str

    @property
    def storages(self) -> Mapping[int, "Storage"]: ...


class HeldElsewhere:
    """Storage places (vp stage, group index and name, ordinal) learned to be held by another reference."""

    __slots__ = ("_places", "probed")

    def __init__(self) -> None:
        self._places: dict[tuple[int, int, str], set[int]] = {}
        self.probed = False
        """Whether a baseline iteration's chunks were all probed since the places were last cleared."""

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

    def probe(self, vp_stage: int, groups: Sequence[ProbedGroup]) -> list[int]:
        """At the forward end of a chunk that copied nothing: learn, without a copy, which of its
        groups' saved storages another reference keeps alive. Returns the bytes learned per group.

        Each original a group holds becomes a detached alias (same storage and version counter);
        a storage with strong references beyond the chunk's aliases is held elsewhere.
        """
        aliases: dict[int, int] = {}  # storage key -> the chunk's aliases of it
        held = []  # per group: (ordinal, key, storage, one of its aliases)
        for group in groups:
            storages = []
            for ordinal, (key, storage) in enumerate(group.storages.items()):
                count, alias = storage.hold_aliases()
                aliases[key] = aliases.get(key, 0) + count
                storages.append((ordinal, key, storage, alias))
            held.append(storages)
        learned = []
        for group, storages in zip(groups, held):
            nbytes = 0
            for ordinal, key, storage, alias in storages:
                if storage.pinned or alias is None:
                    continue
                if storage_use_count(alias) > aliases[key]:
                    self.note(vp_stage, group.index, group.name, ordinal)
                    nbytes += storage.nbytes
            learned.append(nbytes)
        return learned

    def shared_groups(self, vp_stage: int, groups: Sequence[ProbedGroup]) -> list[tuple[int, ...]]:
        """The sets of a chunk's groups that saved one storage held nowhere else (neither pinned nor
        at a known place): copying some of a set frees nothing. Sorted; empty: none."""
        seen: set[int] = set()
        saved = 0
        for group in groups:  # no storage saved twice (the common case): found with set operations
            keys = group.storages.keys()
            saved += len(keys)
            seen.update(keys)
        if len(seen) == saved:
            return []
        owner: dict[int, int] = {}  # storage key -> index of the first group that saved it
        parent = list(range(len(groups)))

        def root(i: int) -> int:
            while parent[i] != i:
                i = parent[i]
            return i

        for position, group in enumerate(groups):
            held = self.kept(vp_stage, group.index, group.name)
            for ordinal, (key, storage) in enumerate(group.storages.items()):
                if storage.pinned or not storage.live or (held is not None and ordinal in held):
                    continue
                first = owner.setdefault(key, position)
                if first != position:
                    parent[root(position)] = root(first)
        sets: dict[int, list[int]] = {}
        for position, group in enumerate(groups):
            sets.setdefault(root(position), []).append(group.index)
        return sorted(tuple(members) for members in sets.values() if len(members) > 1)

    def clear(self) -> None:
        """Forget every place (the offloaded modules changed); the next baseline probes again."""
        self._places.clear()
        self.probed = False

    def __len__(self) -> int:
        return sum(len(places) for places in self._places.values())
