"""The search behind `choose_offload` (NOTE [Budget choice] in budget.py).

`simulate` replays every accounting event of a plan in Python; the search needs the peak of
thousands of candidate choices, so it works on an equivalent model instead. Every event of the
engine's order gets a fixed position (`_budget_layout.Layout`): a group's save, the release
that follows each commit, the reload points of each backward group, the prefetch points, the frees. Saves and
frees do not depend on the choice: they give the baseline profile of resident bytes. A copied
group takes its bytes off the profile from its release to its reload; only the reload point
depends on the choice, and only on the choices within its own chunk (`Layout.reloads` runs the
engine's reload rules, `prefetch_selection` and `reload_ahead_selection`, on that chunk). The
peak of a choice is then the maximum of the profile; `choose_offload` checks its final choice
with `simulate` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ._budget_layout import Chunk, Layout as _Layout, Profile as _Profile
from .plan import Plan

__all__ = ["SearchResult", "model_peak", "search_offload"]

# The searches tried, best (fewest bytes) taken, the first of equals: additions at the peak by
# reach, additions at the peak cheapest first (each then pruned), and pruning from every group copied.
_RULES = ("reach", "peak", "reverse")
# How many of the chosen groups, largest first, `_Search.swap` tries to replace by cheaper ones.
_SWAPS = 16



class _Search:
    """Greedy additions at the peak, then pruning (NOTE [Budget choice])."""

    def __init__(
        self,
        layout: _Layout,
        order: list[Chunk],
        slack: Mapping[Chunk, Sequence[float]],
        target: int,
        shared: Mapping[Chunk, Sequence[Sequence[int]]] | None = None,
    ) -> None:
        self.layout, self.order, self.target = layout, order, target
        self.keys = [(chunk, g) for chunk in order for g in range(len(layout.sizes[chunk]))]
        self.nbytes = np.array([layout.sizes[c][g] for c, g in self.keys], dtype=np.int64)
        self.slack = np.array([slack[c][g] for c, g in self.keys], dtype=np.float64)
        self.release = np.array([layout.release[c][g] for c, g in self.keys], dtype=np.int64)
        self.free = np.array([layout.free[c][g] for c, g in self.keys], dtype=np.int64)
        self.early = np.array([layout.earliest_reload(c, g) for c, g in self.keys], dtype=np.int64)
        self.latest = np.array([layout.latest_reload(c, g) for c, g in self.keys], dtype=np.int64)
        self.index = {key: i for i, key in enumerate(self.keys)}
        # Groups that saved one storage are copied together or not at all: each group's set,
        # itself alone when it shares nothing (NOTE [Storages held elsewhere]).
        self.together: dict[tuple[Chunk, int], frozenset[int]] = {}
        for chunk, sets in (shared or {}).items():
            for members in sets:
                for g in members:
                    self.together[(chunk, g)] = frozenset(members)

    def _set_of(self, chunk: Chunk, g: int) -> frozenset[int]:
        return self.together.get((chunk, g)) or frozenset((g,))

    def forward(self, rule: str, start: _Profile | None = None, banned: frozenset[int] = frozenset()) -> _Profile | None:
        """Add groups at the peak until it fits (``rule``: which unit first, see `_pick`), from
        nothing or from ``start`` (changed in place) never adding a group of ``banned`` (indices
        of `keys`); None when stuck (no single group or pair lowers the peak)."""
        profile = start if start is not None else _Profile(self.layout)
        chosen = np.zeros(len(self.keys), dtype=bool)
        for chunk, groups in profile.copied.items():
            for g in groups:
                chosen[self.index[(chunk, g)]] = True
        for i in banned:
            chosen[i] = True
        while True:
            position = int(profile.values.argmax()) if self.layout.positions else 0
            excess = profile.peak() - self.target
            if excess <= 0:
                return profile
            units = self._units(profile, chosen, position)
            if not units:
                return None
            for i in self._pick(rule, units, profile, excess):
                chunk, g = self.keys[i]
                members = self._set_of(chunk, g)
                if any(chosen[self.index[(chunk, h)]] and h not in profile.copied[chunk] for h in members):
                    chosen[i] = True  # a banned group would come with it: never this one
                    continue
                for h in members:
                    chosen[self.index[(chunk, h)]] = True
                profile.set(chunk, profile.copied[chunk] | members)

    def _pick(self, rule: str, units: list[tuple[int, int, list[int]]], profile: _Profile, excess: int) -> list[int]:
        """The unit to add; hiding units first under both rules.

        ``"peak"``: the cheapest unit that covers the excess alone, else the one that lowers the
        peak most. ``"reach"``: the most excess removed per byte copied over the unit's whole
        time off device (it may lower later peaks too), the excess counted up to the peak's.
        """
        if rule == "reach":
            over = np.concatenate(([0], np.cumsum(np.clip(profile.values - self.target, 0, excess))))

            def key(unit):
                nbytes, gain, (i, *_) = unit
                start, end = self.release[i], self.latest[i]
                value = min(int(over[end] - over[start]), gain * int(end - start))
                return (self.slack[i] < 0, -value / nbytes, nbytes, -self.slack[i], i)

            return min(units, key=key)[2]
        covering = [u for u in units if u[1] >= excess]
        if covering:
            return min(covering, key=lambda u: (self.slack[u[2][0]] < 0, u[0], -self.slack[u[2][0]], u[2][0]))[2]
        return min(units, key=lambda u: (self.slack[u[2][0]] < 0, -u[1], u[0], -self.slack[u[2][0]], u[2][0]))[2]

    def _units(self, profile: _Profile, chosen: np.ndarray, position: int) -> list[tuple[int, int, list[int]]]:
        """(bytes, bytes lowered at ``position``, group indices) for each way to lower the peak."""
        live = ~chosen & (self.nbytes > 0) & (self.release <= position) & (position < self.free)
        safe = live & (position < self.early)  # on host at the peak whatever else is copied
        units = []
        for pick in self._best_safe(np.nonzero(safe)[0], profile.peak() - self.target):
            units.append((int(self.nbytes[pick]), int(self.nbytes[pick]), [int(pick)]))
        unsure: dict[Chunk, list[int]] = {}
        for i in np.nonzero(live & ~safe)[0]:
            unsure.setdefault(self.keys[i][0], []).append(int(i))
        for chunk, indices in unsure.items():
            units.extend(self._chunk_units(profile, chunk, indices, position))
        return units

    def _best_safe(self, indices: np.ndarray, excess: int) -> list[int]:
        """The cheapest safe group covering ``excess`` and the largest one, by preference."""
        if not len(indices):
            return []
        hides_not = self.slack[indices] < 0
        size = self.nbytes[indices]
        picks = [int(indices[np.lexsort((indices, -self.slack[indices], -size, hides_not))[0]])]
        covering = size >= excess
        if covering.any():
            sub = indices[covering]
            picks.append(int(sub[np.lexsort((sub, -self.slack[sub], self.nbytes[sub], self.slack[sub] < 0))[0]]))
        return picks

    def _chunk_units(self, profile: _Profile, chunk: Chunk, indices: list[int], position: int) -> list[tuple[int, int, list[int]]]:
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

    def everything(self) -> _Profile:
        profile = _Profile(self.layout)
        for chunk, sizes in self.layout.sizes.items():
            profile.set(chunk, {g for g, b in enumerate(sizes) if b > 0})
        return profile

    def prune(self, profile: _Profile) -> _Profile:
        """Keep on device again, largest (then least hiding) first, every group the peak fits without.

        The profile fits before each try, so only where bytes came back can it stop fitting."""
        copied = [self.index[(chunk, g)] for chunk, groups in profile.copied.items() for g in groups]
        for i in sorted(copied, key=lambda i: (-int(self.nbytes[i]), self.slack[i] >= 0, self.slack[i], -i)):
            chunk, g = self.keys[i]
            members = self._set_of(chunk, g)
            if g in profile.copied[chunk] and profile.set(chunk, profile.copied[chunk] - members) > self.target:
                profile.set(chunk, profile.copied[chunk] | members)
        return profile

    def swap(self, profile: _Profile) -> _Profile:
        """Keep one copied group on device again (the `_SWAPS` largest, one at a time) and cover
        the excess it leaves with other groups (additions at the peak, then pruning); taken when
        fewer bytes are copied. Pruning leaves no group the peak fits without, but a large group
        may still be worth less than the smaller ones that would replace it."""
        best, best_bytes = profile, self.copied_bytes(profile)
        copied = [self.index[(chunk, g)] for chunk, groups in profile.copied.items() for g in groups]
        for i in sorted(copied, key=lambda i: (-int(self.nbytes[i]), i))[:_SWAPS]:
            chunk, g = self.keys[i]
            members = self._set_of(chunk, g)
            trial = best.clone()
            trial.set(chunk, trial.copied[chunk] - members)
            grown = self.forward("peak", trial, banned=frozenset(self.index[(chunk, h)] for h in members))
            if grown is not None:
                grown = self.prune(grown)
                if self.copied_bytes(grown) < best_bytes:
                    best, best_bytes = grown, self.copied_bytes(grown)
        return best

    def copied_bytes(self, profile: _Profile) -> int:
        return sum(self.layout.sizes[chunk][g] for chunk, groups in profile.copied.items() for g in groups)


@dataclass(frozen=True, slots=True)
class SearchResult:
    offloaded: dict[Chunk, frozenset[int]]
    peak: int
    baseline_peak: int
    lowest_peak: int


def search_offload(
    plan: Plan,
    sizes: Mapping[Chunk, Sequence[int]],
    budget: int,
    *,
    prefetch_bytes: int | None,
    reload_ahead_bytes: int | None,
    slack: Mapping[Chunk, Sequence[float]],
    kept: Mapping[Chunk, Sequence[int]] | None = None,
    shared: Mapping[Chunk, Sequence[Sequence[int]]] | None = None,
) -> SearchResult:
    """Groups to copy so that the predicted peak is at most ``budget`` (else the lowest peak),
    copying few bytes: nothing if the baseline fits; else greedy additions at the peak, then
    pruning (from every group copied where the greedy finds no group or pair that lowers the peak).
    ``shared``: per chunk, sets of groups copied together or not at all."""
    layout = _Layout(plan, sizes, prefetch_bytes, reload_ahead_bytes, kept)
    search = _Search(layout, plan.chunks, slack, budget, shared)
    everything = search.everything()
    baseline, lowest = _Profile(layout).peak(), everything.peak()
    if baseline <= budget:
        return SearchResult({}, baseline, baseline, lowest)
    search.target = max(budget, lowest)
    results = []
    for rule in _RULES:
        grown = search.forward(rule) if rule != "reverse" else None
        results.append(search.prune(grown if grown is not None else search.everything()))
    best = search.swap(min(results, key=search.copied_bytes))  # the first of equals
    offloaded = {chunk: frozenset(groups) for chunk, groups in best.copied.items() if groups}
    return SearchResult(offloaded, best.peak(), baseline, lowest)


def model_peak(
    plan: Plan,
    sizes: Mapping[Chunk, Sequence[int]],
    copied: Mapping[Chunk, Sequence[int]],
    *,
    prefetch_bytes: int | None = None,
    reload_ahead_bytes: int | None = None,
    kept: Mapping[Chunk, Sequence[int]] | None = None,
) -> int:
    """The model's peak for one choice (tests compare it with `simulate`)."""
    profile = _Profile(_Layout(plan, sizes, prefetch_bytes, reload_ahead_bytes, kept))
    for chunk, groups in copied.items():
        profile.set(tuple(chunk), set(groups))
    return profile.peak()
