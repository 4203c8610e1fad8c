"""`OffloadChoice` and `CopyTiming`: what a device-budget choice is, and the timing it may use.

Below both `budget.py` (which makes choices, NOTE [Budget choice]) and `plan_policy.py` (which
applies them, and reads a `CopyTiming` for NOTE [Kept tail]), so that neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..core.actions import Action, ActionKind
from ..core.records import IterationRecord
from .plan import Plan

__all__ = ["TIMING_TOLERANCE", "CopyTiming", "OffloadChoice"]

TIMING_TOLERANCE = 0.1
"""How far a timing may move from the one decisions were last made from before they are made
again (`CopyTiming.close_to`; NOTE [Timed reload ahead by default] in integrations/plan_tracking.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CopyTiming:
    """Measured copy rate and action start times of one offloaded iteration of the plan."""

    bytes_per_s: float
    """Device-to-host copy rate: bytes copied / seconds the copies took on their stream."""
    reload_bytes_per_s: float | None = None
    """Host-to-device rate, measured the same way from the reloads (None: none timed; the
    offload rate stands in). Links may differ by direction."""
    action_starts_s: Sequence[float]
    """For each action of the plan, seconds from the iteration's start at which it began."""
    iteration_s: float
    """Wall time of that iteration."""

    def close_to(self, other: "CopyTiming | None", tolerance: float = TIMING_TOLERANCE) -> bool:
        """Whether ``other`` is this timing give or take ``tolerance``: each link rate within that
        share of the larger, and each action's duration within that share of the larger of the two
        or of the mean action (a short action's jitter is no change). Decisions made from one hold
        for the other: iteration-to-iteration jitter does not remake them."""
        if other is None or len(other.action_starts_s) != len(self.action_starts_s):
            return False
        if (self.reload_bytes_per_s is None) != (other.reload_bytes_per_s is None):
            return False
        rates = [(self.bytes_per_s, other.bytes_per_s)]
        if self.reload_bytes_per_s is not None:
            rates.append((self.reload_bytes_per_s, other.reload_bytes_per_s))
        if any(abs(a - b) > tolerance * max(a, b) for a, b in rates):
            return False
        mine, theirs = self._durations(), other._durations()
        mean = max(self.iteration_s, other.iteration_s) / max(1, len(mine))
        return all(abs(a - b) <= tolerance * max(a, b, mean) for a, b in zip(mine, theirs))

    def _durations(self) -> list[float]:
        """Each action's seconds, to the next action's start (the last: to the iteration's end)."""
        ends = (*self.action_starts_s[1:], self.iteration_s)
        return [end - start for start, end in zip(self.action_starts_s, ends)]

    @classmethod
    def from_record(cls, record: IterationRecord, plan: Plan) -> "CopyTiming | None":
        """The timing of ``record``; None when it copied nothing (a baseline, or copies not
        timed) or its order is not ``plan``'s (a ``W`` of the plan starts when the action
        before it did: the engine does not see weight steps)."""
        copied = sum(g.bytes_offloaded for g in record.groups.values())
        seconds = sum(g.offload_time_s for g in record.groups.values())
        if not record.offload or copied <= 0 or seconds <= 0:
            return None
        seen = [a for a in plan.actions if a.kind is not ActionKind.WEIGHT]
        if [Action.of(a) for a in record.order] != seen or len(record.action_starts_s) != len(seen):
            return None
        starts, recorded = [], iter(record.action_starts_s)
        for action in plan.actions:
            starts.append(starts[-1] if action.kind is ActionKind.WEIGHT and starts else next(recorded, 0.0))
        reloaded = sum(g.bytes_reloaded for g in record.groups.values())
        reload_s = sum(g.reload_time_s for g in record.groups.values())
        back = reloaded / reload_s if reloaded > 0 and reload_s > 0 else None
        return cls(bytes_per_s=copied / seconds, reload_bytes_per_s=back, action_starts_s=tuple(starts), iteration_s=record.wall_time_s)

    def round_trip_s(self, nbytes: int) -> float:
        """Seconds to copy ``nbytes`` to host and back, each direction at its own rate."""
        back = self.bytes_per_s if self.reload_bytes_per_s is None else self.reload_bytes_per_s
        return nbytes / self.bytes_per_s + nbytes / back

    def hides(self, plan: Plan, chunk: tuple[int, int], nbytes: int) -> float:
        """Seconds of compute left after a copy of ``nbytes`` out and back in chunk ``chunk``'s
        window (from the action after its forward to its backward); >= 0: the copy hides."""
        return self.slack_s(plan.index(ActionKind.FORWARD, *chunk), plan.index(ActionKind.BACKWARD, *chunk), nbytes)

    def slack_s(self, forward: int, backward: int, nbytes: int) -> float:
        """`hides` for a chunk whose forward and backward are actions ``forward`` and ``backward`` of the plan."""
        return self.window_s(forward, backward) - self.round_trip_s(nbytes)

    def window_s(self, forward: int, backward: int) -> float:
        """Compute seconds a copy of the chunk with these forward and backward actions can hide
        behind: from the start of the action after its forward to the start of its backward."""
        return self.action_starts_s[backward] - self.action_starts_s[min(forward + 1, backward)]

    def exposed_s(self, forward: int, backward: int, nbytes: int) -> float:
        """Seconds of a round trip of ``nbytes`` (all the bytes one chunk copies: they share the
        link) that its window does not hide, ``max(0, -slack_s)``: the chunk alone on the link
        (NOTE [Link queue] adds the other chunks' copies)."""
        return max(0.0, self.round_trip_s(nbytes) - self.window_s(forward, backward))


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadChoice:
    """The groups a rank copies to host for a device budget, and the peaks `simulate` predicts."""

    budget_bytes: int
    offloaded: Mapping[tuple[int, int], frozenset[int]]
    """(microbatch, vp_stage) -> indices of the chunk's groups copied to host; all others stay on device."""
    predicted_peak_bytes: int
    """`simulate`'s peak of device-resident saved bytes with this choice."""
    baseline_peak_bytes: int
    """The peak with nothing offloaded."""
    lowest_peak_bytes: int
    """The peak with every group offloaded (prefetch and reload-ahead budgets included)."""
    bytes_offloaded: int
    """Bytes copied to host per iteration with this choice."""
    exposed_s: float | None = field(default=None, compare=False)
    """With a `CopyTiming`: the predicted seconds of link time per iteration that compute does
    not hide, all chunks' copies queued on the link (NOTE [Link queue]), which the choice
    minimised before bytes (NOTE [Budget choice]); None when chosen without timing. A
    prediction from measured times, not part of the decision: two choices of the same groups and
    peaks are equal whatever it reads."""

    @property
    def fits(self) -> bool:
        """Whether the predicted peak is within the budget."""
        return self.predicted_peak_bytes <= self.budget_bytes

    @property
    def groups_offloaded(self) -> int:
        """Number of (chunk, group) pairs copied."""
        return sum(len(groups) for groups in self.offloaded.values())

    def offloaded_by_name(self, group_names: Mapping[tuple[int, int], Sequence[str]]) -> dict[str, int]:
        """Group name -> number of offloaded groups of that name (``IterationRecord.group_names``)."""
        counts: dict[str, int] = {}
        for chunk, groups in sorted(self.offloaded.items()):
            names = group_names.get(chunk, ())
            for index in sorted(groups):
                name = names[index] if index < len(names) else f"group {index}"
                counts[name] = counts.get(name, 0) + 1
        return counts
