"""The fixed event positions of a plan that `_budget_search` draws choices on (see its docstring).

`_Layout` gives every event of the engine's order (`simulate`'s) a position: a group's save, the
release that follows each commit, the reload points of each backward group, the prefetch points,
the frees; saves and frees give the baseline profile of resident bytes, and `reloads` runs the
engine's reload rules (`prefetch_selection`, `reload_ahead_selection`) for one chunk's choice.
`Profile` draws one choice on a layout: resident bytes at every position, changed chunk by chunk.
"""

from __future__ import annotations

import itertools
from typing import Mapping, Sequence

import numpy as np

from ..core import GroupState, prefetch_selection, reload_ahead_selection
from ..core.actions import ActionKind
from .plan import Plan

__all__ = ["Chunk", "Layout", "Profile"]

Chunk = tuple[int, int]
_ON_HOST, _RESIDENT = GroupState.ON_HOST, GroupState.RESIDENT


class Layout:
    """Fixed event positions of one plan, in `simulate`'s (the engine's) order."""

    def __init__(
        self,
        plan: Plan,
        sizes: Mapping[Chunk, Sequence[int]],
        prefetch_bytes: int | None,
        reload_ahead_bytes: int | None,
        kept: Mapping[Chunk, Sequence[int]] | None = None,
    ) -> None:
        self.saved = {chunk: list(sizes[chunk]) for chunk in plan.chunks}
        """Saved bytes per group: the baseline's saves and frees, and the reload rules' budgets (as the engine)."""
        self.sizes = self.saved
        """Bytes a copy of each group moves: saved minus what it keeps on device (`simulate`'s ``kept_bytes``)."""
        if kept is not None:
            self.sizes = {chunk: [s - k for s, k in zip(self.saved[chunk], kept[chunk], strict=True)] for chunk in plan.chunks}
        self.reload_ahead_bytes = reload_ahead_bytes
        self.release: dict[Chunk, list[int]] = {}
        self.free: dict[Chunk, list[int]] = {}
        self.reload_self: dict[Chunk, list[int]] = {}
        self.reload_ahead: dict[Chunk, list[int]] = {}
        self.prefetch: dict[Chunk, tuple[int, int | None]] = {}  # chunk -> (position, budget)
        deltas: list[tuple[int, int]] = []
        weights = {a.chunk for a in plan.actions if a.kind is ActionKind.WEIGHT}
        forwarded: set[Chunk] = set()
        actions = plan.actions
        take = itertools.count().__next__  # the next position

        def request(step: int) -> None:  # PlanPolicy.prefetch_on, skipped as simulate skips it
            following = actions[step + 1] if step + 1 < len(actions) else None
            if prefetch_bytes != 0 and following is not None and following.kind is ActionKind.BACKWARD and following.chunk in forwarded:
                self.prefetch[following.chunk] = (take(), prefetch_bytes)

        for step, action in enumerate(actions):
            chunk, n = action.chunk, len(self.sizes[action.chunk])
            free = self.free.setdefault(chunk, [0] * n)
            if action.kind is ActionKind.FORWARD:
                request(step)
                commits = []
                for g in range(n):
                    deltas.append((take(), self.saved[chunk][g]))  # the group's save
                    commits.append(take())  # its commit releases the group held before it
                self.release[chunk] = commits[1:] + [take()]  # the chunk's end releases the last
                forwarded.add(chunk)
            elif action.kind is ActionKind.BACKWARD:
                rs, ra = [0] * n, [0] * n
                for g in reversed(range(n)):
                    rs[g], ra[g] = take(), take()
                    if g == n - 1:
                        request(step)
                    if chunk not in weights:
                        free[g] = take()
                self.reload_self[chunk], self.reload_ahead[chunk] = rs, ra
            else:
                for g in reversed(range(n)):
                    free[g] = take()
        self.positions = take()
        profile = np.zeros(self.positions + 1, dtype=np.int64)
        for position, nbytes in deltas:
            profile[position] += nbytes
        for chunk, free in self.free.items():
            for g, position in enumerate(free):
                profile[position] -= self.saved[chunk][g]
        self.baseline = np.cumsum(profile)[: self.positions]

    def earliest_reload(self, chunk: Chunk, g: int) -> int:
        """No choice reloads group ``g`` of ``chunk`` before this position: its chunk's prefetch,
        else backward's one-ahead reload (with a reload-ahead budget: the chunk's first backward step)."""
        rs, ra = self.reload_self[chunk], self.reload_ahead[chunk]
        if self.reload_ahead_bytes is not None:
            first = rs[-1]
        else:
            first = ra[g + 1] if g + 1 < len(rs) else rs[g]
        return min(first, self.prefetch[chunk][0]) if chunk in self.prefetch else first

    def latest_reload(self, chunk: Chunk, g: int) -> int:
        """No choice reloads group ``g`` of ``chunk`` after this position (its own backward step)."""
        return self.reload_self[chunk][g]

    def prefetched(self, chunk: Chunk, copied: set[int] | frozenset[int]) -> list[int]:
        """The groups of ``copied`` the chunk's prefetch reloads (`prefetch_selection`)."""
        if chunk not in self.prefetch or not copied:
            return []
        sizes = self.sizes[chunk]
        budget = self.prefetch[chunk][1]
        if budget is None:  # prefetch_selection's one-group rule, without building the list
            top = max((g for g in copied if sizes[g] > 0), default=None)
            return [] if top is None else [top]
        states = [_ON_HOST if g in copied and b > 0 else GroupState.KEPT for g, b in enumerate(sizes)]
        return prefetch_selection(list(zip(states, self.saved[chunk])), budget)

    def reloads(self, chunk: Chunk, copied: set[int] | frozenset[int]) -> dict[int, int]:
        """Group -> position of its reload, for the groups ``copied`` of ``chunk``."""
        sizes = self.sizes[chunk]
        rs, ra, budget = self.reload_self[chunk], self.reload_ahead[chunk], self.reload_ahead_bytes
        early = self.prefetched(chunk, copied)
        at = dict.fromkeys(early, self.prefetch[chunk][0]) if early else {}
        if budget is None:
            # Backward reloads the group before the running one (reload_ahead_selection's
            # one-ahead rule); the last group, unless prefetched, when its own backward starts.
            n = len(sizes)
            for g in copied:
                if g not in at and sizes[g] > 0:
                    at[g] = ra[g + 1] if g + 1 < n else rs[g]
            return at
        states = [_ON_HOST if g in copied and b > 0 and g not in at else GroupState.KEPT for g, b in enumerate(sizes)]
        for g in early:
            states[g] = _RESIDENT
        for g in reversed(range(len(sizes))):
            if states[g] is _ON_HOST:
                states[g], at[g] = _RESIDENT, rs[g]
            for i in reload_ahead_selection(list(zip(states, self.saved[chunk])), g, budget):
                states[i], at[i] = _RESIDENT, ra[g]
        return at


class Profile:
    """Resident bytes at every position of a `Layout` for one choice; groups added and removed."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.values = layout.baseline.copy()
        self.copied: dict[Chunk, set[int]] = {chunk: set() for chunk in layout.sizes}
        self.moved: dict[Chunk, int] = dict.fromkeys(layout.sizes, 0)
        """Bytes each chunk's copied groups move: what its link time is counted on (`_budget_link`)."""
        self.spans: dict[Chunk, dict[int, tuple[int, int]]] = {chunk: {} for chunk in layout.sizes}

    def spans_for(self, chunk: Chunk, copied: set[int]) -> dict[int, tuple[int, int]]:
        release, sizes = self.layout.release[chunk], self.layout.sizes[chunk]
        return {g: (release[g], at) for g, at in self.layout.reloads(chunk, copied).items() if sizes[g] > 0}

    def set(self, chunk: Chunk, copied: set[int]) -> int:
        """Copy exactly the groups ``copied`` of ``chunk`` (only the spans that change are redrawn);
        returns the highest value where bytes came back on device (-1 if nowhere)."""
        old, new = self.spans[chunk], self.spans_for(chunk, copied)
        sizes, values, raised = self.layout.sizes[chunk], self.values, -1
        for g, span in old.items():
            if new.get(g) != span:
                values[span[0] : span[1]] += sizes[g]
        for g, span in new.items():
            if old.get(g) != span:
                values[span[0] : span[1]] -= sizes[g]
        for g, span in old.items():
            if new.get(g) != span and span[0] < span[1]:
                raised = max(raised, int(values[span[0] : span[1]].max()))
        self.copied[chunk], self.spans[chunk] = set(copied), new
        self.moved[chunk] = sum(sizes[g] for g in copied)
        return raised

    def clone(self) -> "Profile":
        """An independent copy of this choice."""
        other = Profile.__new__(Profile)
        other.layout, other.values, other.moved = self.layout, self.values.copy(), dict(self.moved)
        other.copied = {chunk: set(groups) for chunk, groups in self.copied.items()}
        other.spans = {chunk: dict(spans) for chunk, spans in self.spans.items()}
        return other

    def covered(self, chunk: Chunk, spans: dict[int, tuple[int, int]], position: int) -> int:
        sizes = self.layout.sizes[chunk]
        return sum(sizes[g] for g, (start, end) in spans.items() if start <= position < end)

    def peak(self) -> int:
        return max(int(self.values.max()), 0) if self.layout.positions else 0
