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

import heapq
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ._budget_layout import Chunk, Layout as _Layout, Profile as _Profile
from ._budget_link import Link
from ._budget_units import Groups
from .plan import Plan

__all__ = ["SearchResult", "model_peak", "search_offload"]

# The searches tried, the cheapest taken (`_Search.cost`), the first of equals: additions at the
# peak by reach, additions at the peak cheapest first (each then pruned), and pruning from every
# group copied.
_RULES = ("reach", "peak", "reverse")
# How many of the chosen groups, costliest first, `_Search.swap` tries to replace by cheaper ones.
_SWAPS = 16
# Exposed seconds are compared to the nanosecond, so that sums in another order tie.
_SECONDS_DIGITS = 9


class _Search(Groups):
    """Greedy additions at the peak, then pruning (NOTE [Budget choice])."""

    def __init__(
        self,
        layout: _Layout,
        order: list[Chunk],
        slack: Mapping[Chunk, Sequence[float]],
        target: int,
        shared: Mapping[Chunk, Sequence[Sequence[int]]] | None = None,
        link: Link | None = None,
    ) -> None:
        super().__init__(layout, order, slack, shared, link)
        self.target = target

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
            units = self.units(profile, chosen, position, excess)
            if not units:
                return None
            for i in self._pick(rule, units, profile, excess):
                chunk, g = self.keys[i]
                members = self.set_of(chunk, g)
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
        With a `Link`, a unit hides when it adds no exposed seconds to the choice; "cheapest" is
        the fewest exposed seconds, then bytes, and units that do not hide rank by the excess
        removed per exposed second instead of per byte.
        """
        exposed = self.units_exposed(profile, units).tolist() if self.link is not None else None

        def late(k: int) -> tuple[bool, float | None]:  # (does not hide, exposed seconds it adds if it does not)
            if exposed is None:
                return bool(self.slack[units[k][2][0]] < 0), None
            return exposed[k] > 0, exposed[k] if exposed[k] > 0 else None

        def tail(k: int) -> tuple:
            return (units[k][0], -self.slack[units[k][2][0]], units[k][2][0])

        if rule == "reach":
            over = np.concatenate(([0], np.cumsum(np.clip(profile.values - self.target, 0, excess))))

            def key(k: int) -> tuple:
                nbytes, gain, (i, *_) = units[k]
                start, end = self.release[i], self.latest[i]
                value = min(int(over[end] - over[start]), gain * int(end - start))
                hides_not, per = late(k)
                return (hides_not, -value / (nbytes if per is None else per), *tail(k))

            return units[min(range(len(units)), key=key)][2]
        covering = [k for k in range(len(units)) if units[k][1] >= excess]
        if covering:
            return units[min(covering, key=lambda k: (late(k)[0] if exposed is None else exposed[k], *tail(k)))][2]

        def lowering(k: int) -> tuple:
            hides_not, per = late(k)
            return (hides_not, -units[k][1] if per is None else -units[k][1] / per, *tail(k))

        return units[min(range(len(units)), key=lowering)][2]

    def everything(self) -> _Profile:
        profile = _Profile(self.layout)
        for chunk, sizes in self.layout.sizes.items():
            profile.set(chunk, {g for g, b in enumerate(sizes) if b > 0})
        return profile

    def prune(self, profile: _Profile) -> _Profile:
        """Keep on device again, costliest first (`_give_back`), every group the peak fits without.

        The profile fits before each try, so only where bytes came back can it stop fitting. A
        group's exposed seconds change as other groups go back (of any chunk: they share the
        link, NOTE [Link queue]), so a key popped is recomputed and the group tried only once its
        key still holds (a lazy heap)."""
        copied = [self.index[(chunk, g)] for chunk, groups in profile.copied.items() for g in groups]
        heap = [(key, i, 0) for key, i in zip(self._give_back(profile, copied), copied)]  # (key, group, choice it was found on)
        heapq.heapify(heap)
        changes = 0  # groups kept back so far: the choice a key was found on
        while heap:
            key, i, seen = heapq.heappop(heap)
            chunk, g = self.keys[i]
            if g not in profile.copied[chunk]:
                continue  # went back with its shared set
            if self.link is not None and seen != changes and (now := self._give_back(profile, [i])[0]) != key:
                heapq.heappush(heap, (now, i, changes))
                continue
            members = self.set_of(chunk, g)
            if profile.set(chunk, profile.copied[chunk] - members) > self.target:
                profile.set(chunk, profile.copied[chunk] | members)
            else:
                changes += 1
        return profile

    def _give_back(self, profile: _Profile, indices: list[int]) -> list[tuple]:
        """Prune order of copied groups ``indices``: largest, then least hiding, first; with a
        `Link`, the most exposed seconds keeping one (its set) on device gives back, first of all."""
        keys = [(-int(self.nbytes[i]), bool(self.slack[i] >= 0), float(self.slack[i]), -i) for i in indices]
        if self.link is None:
            return keys
        back = []
        for i in indices:
            chunk, g = self.keys[i]
            back.append(-sum(self.layout.sizes[chunk][h] for h in self.set_of(chunk, g) & profile.copied[chunk]))
        if len(indices) == 1:  # one walk of floats, not of arrays
            seconds = [self.link.added(profile.moved, int(self.chunk_at[indices[0]]), back[0])]
        else:
            seconds = self.link.added_each(profile.moved, self.chunk_at[indices], np.array(back, dtype=np.int64)).tolist()
        return [(s, *key) for s, key in zip(seconds, keys)]

    def swap(self, profile: _Profile) -> _Profile:
        """Keep one copied group on device again (the `_SWAPS` costliest in prune order, one at a
        time) and cover the excess it leaves with other groups (additions at the peak, then
        pruning); taken when cheaper (`cost`). Pruning leaves no group the peak fits without, but
        a large group may still be worth less than the smaller ones that would replace it."""
        best, best_cost = profile, self.cost(profile)
        copied = [self.index[(chunk, g)] for chunk, groups in profile.copied.items() for g in groups]
        # Largest first; with a `Link`, the most exposed seconds given back first.
        seconds = [key[0] for key in self._give_back(profile, copied)] if self.link is not None else [0.0] * len(copied)
        for _, _, i in sorted(zip(seconds, (-int(self.nbytes[i]) for i in copied), copied))[:_SWAPS]:
            chunk, g = self.keys[i]
            members = self.set_of(chunk, g)
            trial = best.clone()
            trial.set(chunk, trial.copied[chunk] - members)
            grown = self.forward("peak", trial, banned=frozenset(self.index[(chunk, h)] for h in members))
            if grown is not None:
                grown = self.prune(grown)
                if self.cost(grown) < best_cost:
                    best, best_cost = grown, self.cost(grown)
        return best

    def cost(self, profile: _Profile) -> int | tuple[float, int]:
        """What the search minimises: bytes copied; with a `Link`, exposed seconds, then bytes."""
        if self.link is None:
            return self.copied_bytes(profile)
        return round(self.link.total(profile.moved), _SECONDS_DIGITS), self.copied_bytes(profile)

    def copied_bytes(self, profile: _Profile) -> int:
        return sum(self.layout.sizes[chunk][g] for chunk, groups in profile.copied.items() for g in groups)


@dataclass(frozen=True, slots=True)
class SearchResult:
    offloaded: dict[Chunk, frozenset[int]]
    peak: int
    baseline_peak: int
    lowest_peak: int
    exposed_s: float | None = None
    """With a `Link`: the choice's exposed link seconds (`Link.total`)."""


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
    link: Link | None = None,
) -> SearchResult:
    """Groups to copy so that the predicted peak is at most ``budget`` (else the lowest peak),
    copying few bytes (with ``link``: exposing few link seconds, then few bytes): nothing if the
    baseline fits; else greedy additions at the peak, then pruning (from every group copied
    where the greedy finds no group or pair that lowers the peak). ``shared``: per chunk, sets
    of groups copied together or not at all."""
    layout = _Layout(plan, sizes, prefetch_bytes, reload_ahead_bytes, kept)
    search = _Search(layout, plan.chunks, slack, budget, shared, link)
    everything = search.everything()
    baseline, lowest = _Profile(layout).peak(), everything.peak()
    if baseline <= budget:
        return SearchResult({}, baseline, baseline, lowest, None if link is None else 0.0)
    search.target = max(budget, lowest)
    results = []
    for rule in _RULES:
        grown = search.forward(rule) if rule != "reverse" else None
        results.append(search.prune(grown if grown is not None else search.everything()))
    best = search.swap(min(results, key=search.cost))  # the first of equals
    offloaded = {chunk: frozenset(groups) for chunk, groups in best.copied.items() if groups}
    return SearchResult(offloaded, best.peak(), baseline, lowest, None if link is None else link.total(best.moved))


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
