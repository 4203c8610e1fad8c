"""The groups a budget search may copy, and the ways ("units") to lower the peak at one position.

`Groups` holds one row per (chunk, group) of the plan (`_budget_search._Search` builds on it):
bytes, how well the copy hides, its release and its earliest and latest reload positions
(`_budget_layout.Layout`), and the sets of groups copied together. `units` lists, for the
current choice and the position of its peak, each group or pair whose copy puts bytes on host
there; with a `Link`, `units_exposed` is the exposed link seconds each unit adds (NOTE [Link queue]).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ._budget_layout import Chunk, Layout, Profile
from ._budget_link import Link

__all__ = ["Groups"]


class Groups:
    """Per-group arrays of one search, indexed like ``keys``, and the units built from them."""

    def __init__(
        self,
        layout: Layout,
        order: list[Chunk],
        slack: Mapping[Chunk, Sequence[float]],
        shared: Mapping[Chunk, Sequence[Sequence[int]]] | None = None,
        link: Link | None = None,
    ) -> None:
        self.layout, self.order, self.link = layout, order, link
        self.keys = [(chunk, g) for chunk in order for g in range(len(layout.sizes[chunk]))]
        self.nbytes = np.array([layout.sizes[c][g] for c, g in self.keys], dtype=np.int64)
        self.slack = np.array([slack[c][g] for c, g in self.keys], dtype=np.float64)
        self.release = np.array([layout.release[c][g] for c, g in self.keys], dtype=np.int64)
        self.free = np.array([layout.free[c][g] for c, g in self.keys], dtype=np.int64)
        self.early = np.array([layout.earliest_reload(c, g) for c, g in self.keys], dtype=np.int64)
        self.latest = np.array([layout.latest_reload(c, g) for c, g in self.keys], dtype=np.int64)
        self.index = {key: i for i, key in enumerate(self.keys)}
        self.chunk_at = np.array([n for n, chunk in enumerate(order) for _ in layout.sizes[chunk]], dtype=np.int64)
        # Groups that saved one storage are copied together or not at all: each group's set,
        # itself alone when it shares nothing (NOTE [Storages held elsewhere]).
        self.together: dict[tuple[Chunk, int], frozenset[int]] = {}
        for chunk, sets in (shared or {}).items():
            for members in sets:
                for g in members:
                    self.together[(chunk, g)] = frozenset(members)

    def set_of(self, chunk: Chunk, g: int) -> frozenset[int]:
        """The groups of ``chunk`` copied together with ``g`` (``g`` alone when it shares nothing)."""
        return self.together.get((chunk, g)) or frozenset((g,))

    def units_exposed(self, profile: Profile, units: list[tuple[int, int, list[int]]]) -> np.ndarray:
        """Exposed seconds adding each unit (bytes, gain, group indices) adds to the choice (`Link.added_each`)."""
        return self.link.added_each(profile.moved, *self._changes(profile, units))

    def _changes(self, profile: Profile, units: list[tuple[int, int, list[int]]]) -> tuple[np.ndarray, np.ndarray]:
        """Each unit's chunk (index in ``order``) and the bytes adding it copies more."""
        chunks = np.array([self.chunk_at[unit[2][0]] for unit in units], dtype=np.int64)  # a unit's groups share one chunk
        more = np.array([unit[0] for unit in units], dtype=np.int64)
        if self.together:  # shared sets come whole
            for n, unit in enumerate(units):
                chunk = self.keys[unit[2][0]][0]
                members = set().union(*(self.set_of(*self.keys[i]) for i in unit[2])) - profile.copied[chunk]
                more[n] = sum(self.layout.sizes[chunk][h] for h in members)
        return chunks, more

    def units(self, profile: Profile, chosen: np.ndarray, position: int, excess: int) -> list[tuple[int, int, list[int]]]:
        """(bytes, bytes lowered at ``position``, group indices) for each way to lower the peak
        there by ``excess``, never with a group ``chosen`` (copied or banned)."""
        live = ~chosen & (self.nbytes > 0) & (self.release <= position) & (position < self.free)
        safe = live & (position < self.early)  # on host at the peak whatever else is copied
        unsure: dict[Chunk, list[int]] = {}
        for i in np.nonzero(live & ~safe)[0]:
            unsure.setdefault(self.keys[i][0], []).append(int(i))
        others = []
        for chunk, indices in unsure.items():
            others.extend(self._chunk_units(profile, chunk, indices, position))
        picks = self._best_safe(profile, np.nonzero(safe)[0], excess, others)
        return [(int(self.nbytes[pick]), int(self.nbytes[pick]), [int(pick)]) for pick in picks] + others

    def _best_safe(self, profile: Profile, indices: np.ndarray, excess: int, others: list[tuple[int, int, list[int]]]) -> list[int]:
        """The cheapest safe group covering ``excess`` and the largest one, by preference (with a
        `Link`, the exposed seconds of the ``others`` units are found in the same walk)."""
        if not len(indices):
            return []
        if self.link is not None:
            return self._best_safe_timed(profile, indices, excess, others)
        hides_not = self.slack[indices] < 0
        size = self.nbytes[indices]
        picks = [int(indices[np.lexsort((indices, -self.slack[indices], -size, hides_not))[0]])]
        covering = size >= excess
        if covering.any():
            sub = indices[covering]
            picks.append(int(sub[np.lexsort((sub, -self.slack[sub], self.nbytes[sub], self.slack[sub] < 0))[0]]))
        return picks

    def _best_safe_timed(self, profile: Profile, indices: np.ndarray, excess: int, others: list[tuple[int, int, list[int]]]) -> list[int]:
        """With a `Link`: the largest safe group that hides, the one that does not with the most
        bytes per exposed second, and the covering one adding the fewest exposed seconds."""
        size = self.nbytes[indices]
        chunks, more = self._changes(profile, others)
        exposed = self.link.added_each(profile.moved, np.concatenate((self.chunk_at[indices], chunks)), np.concatenate((size, more)))[: len(indices)]
        picks, hides = [], exposed <= 0
        if hides.any():
            sub = indices[hides]
            picks.append(int(sub[np.lexsort((sub, -self.slack[sub], -self.nbytes[sub]))[0]]))
        if not hides.all():
            sub, seconds = indices[~hides], exposed[~hides]
            picks.append(int(sub[np.lexsort((sub, self.nbytes[sub], -self.nbytes[sub] / seconds))[0]]))
        covering = size >= excess
        if covering.any():
            sub = indices[covering]
            picks.append(int(sub[np.lexsort((sub, -self.slack[sub], self.nbytes[sub], exposed[covering]))[0]]))
        return list(dict.fromkeys(picks))

    def _chunk_units(self, profile: Profile, chunk: Chunk, indices: list[int], position: int) -> list[tuple[int, int, list[int]]]:
        """Units from a chunk whose reloads may start before the peak: one group, or a group with
        the cheapest group above it (which then takes the prefetch that would bring it back)."""
        layout = self.layout
        copied = profile.copied[chunk]
        sizes = layout.sizes[chunk]
        cheapest: list[tuple[int, int] | None] = [None] * (len(sizes) + 1)  # (bytes, group) above each group
        for h in reversed(range(len(sizes))):
            here = (sizes[h], h) if h not in copied and sizes[h] > 0 else None
            cheapest[h] = min(filter(None, (here, cheapest[h + 1])), default=None)
        prefetch = layout.prefetch.get(chunk)
        if layout.reload_ahead_bytes is None and (prefetch is None or prefetch[1] is None):
            gain_of = self._one_ahead_gains(chunk, copied, position)
        else:
            now = profile.covered(chunk, profile.spans[chunk], position)

            def gain_of(*added: int) -> int:
                return profile.covered(chunk, profile.spans_for(chunk, copied | set(added)), position) - now

        units = []
        for i in indices:
            g = self.keys[i][1]
            gain = gain_of(g)
            if gain > 0:
                units.append((sizes[g], gain, [i]))
                continue
            shield = cheapest[g + 1]
            if shield is not None:
                nbytes, h = shield
                gain = gain_of(g, h)
                if gain > 0:
                    units.append((sizes[g] + nbytes, gain, [i, self.index[(chunk, h)]]))
        return units

    def _one_ahead_gains(self, chunk: Chunk, copied: set[int], position: int):
        """Bytes on host at ``position`` that copying one or two more groups adds, in O(1), under
        the default reloads: a prefetch of the highest copied group, one group ahead in backward."""
        layout = self.layout
        sizes, rs, ra = layout.sizes[chunk], layout.reload_self[chunk], layout.reload_ahead[chunk]
        n = len(sizes)
        prefetch = layout.prefetch.get(chunk)
        top = max((g for g in copied if sizes[g] > 0), default=None)

        def away(h: int, prefetched: bool) -> int:  # h's bytes if h is on host at the position
            back = prefetch[0] if prefetched else ra[h + 1] if h + 1 < n else rs[h]
            return sizes[h] if back > position else 0

        def gain(*added: int) -> int:
            if prefetch is None:
                return sum(away(g, False) for g in added)
            new_top = max(added) if top is None else max(top, *added)
            total = sum(away(g, g == new_top) for g in added)
            if top is not None and new_top != top:  # the prefetch now brings back the new top instead
                total += away(top, False) - away(top, True)
            return total

        return gain
