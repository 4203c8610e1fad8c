"""Reloading ahead under a device budget: which chunks of a choice may, and a choice that leaves them room.

NOTE [Reload room]
A choice (`choose_offload`) is made reloading one group ahead; reloading more ahead (NOTE
[Timed reload ahead] in core/ordering.py) starts a chunk's reloads earlier within its backward
and may raise the peak there, and only there. `fit_reload_ahead` keeps the timed budgets of
the chunks whose backward still fits. Where a chunk's peak is at the start of its backward
(PP=1, the last stage under 1F1B), a choice that just meets the budget leaves none of them
room. `choose_with_reload_ahead` then also tries choices made for a lower budget, each lower by
what the previous one's reloads ahead overshot it (a few rounds, down to the lowest peak): they
copy more, keep less on device, and so leave room under the real budget. Each is fitted under
the real budget and the one whose backwards are predicted to wait least on reloads is taken
(`PlanPolicy.predicted_reload_waits`), if it waits less by 1% of the timed iteration at least
(on CPU streams without a simulated link, timings are the host's noise), else the choice made
for the budget itself. The comparison is of reload waits alone: the copies to host are issued
at each group's commit and overlap the forward of the groups after it, which the model does not
weigh. A chunk whose whole timed budget does not fit reloads ahead what its backward's room
allows (the budget bounds the bytes reloaded ahead, so the peak there rises by at most that
much), where that waits less than one group ahead. Cost on the 70B-like plan of NOTE [Budget choice]: one `choose_offload` where
the choice made for the budget waits least or leaves its chunks room, up to five where every
lower one is tried (1.4 to 6.6 s of CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from ..core.actions import ActionKind
from .budget import choose_offload
from .choice import CopyTiming, OffloadChoice
from .plan import Plan
from .plan_policy import PlanPolicy
from .simulate import GroupBytes, Simulation, _lookup, simulate

__all__ = ["TimedChoice", "choose_with_reload_ahead", "fit_reload_ahead"]

_ROUNDS = 4
"""Lower choices tried at most (NOTE [Reload room]): each costs one `choose_offload`."""

_MARGIN = 0.01
"""A lower choice is taken only if its reloads are predicted to wait less by this share of the
timed iteration at least (NOTE [Reload room]): it copies more, at costs the model leaves out."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TimedChoice:
    """A device-budget choice with the timed reload-ahead budgets that fit it (NOTE [Reload room])."""

    choice: OffloadChoice
    """The groups copied; ``budget_bytes`` is the budget asked for, whatever budget it was made for."""
    chunk_reload_ahead: Mapping[tuple[int, int], int]
    """Per chunk its reload-ahead bytes, for `PlanPolicy`'s ``chunk_reload_ahead``."""
    made_for_bytes: int
    """The budget the choice was made for: the budget asked for, or a lower one that leaves room."""
    predicted_wait_s: float
    """Seconds compute is predicted to wait on reloads per iteration with it."""
    budget_choice_wait_s: float
    """The same for the choice made for the budget asked for, with the budgets that fit it."""


def fit_reload_ahead(
    choice: OffloadChoice,
    plan: Plan,
    group_bytes: GroupBytes,
    timing: CopyTiming,
    *,
    prefetch_bytes: int | None = None,
    kept_bytes: GroupBytes | None = None,
) -> dict[tuple[int, int], int]:
    """Per chunk, the reload-ahead bytes ``timing`` gives the groups ``choice`` copies (NOTE
    [Timed reload ahead] in core/ordering.py), kept where the predicted peak stays within the
    choice's budget (or, for a budget out of reach, its predicted peak); for `PlanPolicy`'s
    ``chunk_reload_ahead``. Empty where one group ahead waits least.

    More bytes ahead may raise the peak during a chunk's own backward only (the same reloads end
    no later, and no other chunk's reloads change). So one `simulate` with every chunk's budget
    shows which chunks' backwards still fit: those keep theirs, and the others get what their
    backward's room allows where that waits less (NOTE [Reload room]). A second checks the
    result; were it over (a plan the argument misses), chunks are tried one at a time in
    backward order.
    """
    return _fit(choice, plan, group_bytes, timing, prefetch_bytes=prefetch_bytes, kept_bytes=kept_bytes)[0]


def choose_with_reload_ahead(
    plan: Plan,
    group_bytes: GroupBytes,
    budget_bytes: int,
    timing: CopyTiming,
    *,
    prefetch_bytes: int | None = None,
    kept_bytes: GroupBytes | None = None,
    shared: Mapping[tuple[int, int], Sequence[Sequence[int]]] | None = None,
) -> TimedChoice:
    """The choice for ``budget_bytes`` and its fitted reload-ahead budgets that wait least on
    reloads, among the choice made for the budget and choices made lower (NOTE [Reload room]).
    Arguments as `choose_offload` takes them."""

    def fitted(target: int) -> tuple[TimedChoice, int]:
        choice = choose_offload(plan, group_bytes, target, prefetch_bytes=prefetch_bytes, timing=timing, kept_bytes=kept_bytes, shared=shared)
        choice = dataclasses.replace(choice, budget_bytes=budget_bytes)
        budgets, over = _fit(choice, plan, group_bytes, timing, prefetch_bytes=prefetch_bytes, kept_bytes=kept_bytes)
        policy = PlanPolicy(plan, offload_groups=choice, prefetch_bytes=prefetch_bytes, chunk_reload_ahead=budgets)
        wait = sum(policy.predicted_reload_waits(group_bytes, timing).values())
        return TimedChoice(choice=choice, chunk_reload_ahead=budgets, made_for_bytes=target, predicted_wait_s=wait, budget_choice_wait_s=wait), over

    first, over = fitted(budget_bytes)
    best, target = first, budget_bytes
    margin = _MARGIN * timing.iteration_s
    for _ in range(_ROUNDS):
        lower = max(first.choice.lowest_peak_bytes, target - over)
        if not first.choice.fits or over <= 0 or lower >= target or best.predicted_wait_s == 0.0:
            break
        target = lower
        candidate, over = fitted(target)
        if candidate.predicted_wait_s + margin < best.predicted_wait_s:
            best = candidate
    return dataclasses.replace(best, budget_choice_wait_s=first.predicted_wait_s)


def _fit(
    choice: OffloadChoice, plan: Plan, group_bytes: GroupBytes, timing: CopyTiming, *, prefetch_bytes: int | None, kept_bytes: GroupBytes | None
) -> tuple[dict[tuple[int, int], int], int]:
    """`fit_reload_ahead`, and the bytes by which every chunk's timed budget together would
    exceed the limit (<= 0: none does)."""
    fitter = _Fitter(choice, plan, group_bytes, timing, prefetch_bytes=prefetch_bytes, kept_bytes=kept_bytes)
    timed = fitter.policy({}).reload_ahead_from(fitter.sizes, timing)
    if not timed:
        return timed, 0
    every = fitter.simulated(timed)
    over = every.peak_resident_bytes - fitter.limit
    if over <= 0:
        return timed, over
    peaks = _step_peaks(every.timeline_with)
    fitted = {chunk: nbytes for chunk, nbytes in timed.items() if peaks.get(fitter.backward[chunk], 0) <= fitter.limit}
    check = fitter.simulated(fitted)
    if check.peak_resident_bytes <= fitter.limit:
        return fitter.with_room(fitted, timed, check), over
    fitted = {}
    for action in plan.actions:
        if action.kind is ActionKind.BACKWARD and action.chunk in timed:
            trial = {**fitted, action.chunk: timed[action.chunk]}
            if fitter.simulated(trial).peak_resident_bytes <= fitter.limit:
                fitted = trial
    return fitted, over


class _Fitter:
    """One choice's reload-ahead budgets under its limit: the policies and simulations `_fit` compares."""

    def __init__(
        self, choice: OffloadChoice, plan: Plan, group_bytes: GroupBytes, timing: CopyTiming, *, prefetch_bytes: int | None, kept_bytes: GroupBytes | None
    ) -> None:
        lookup = _lookup(group_bytes)
        self.choice, self.plan, self.timing = choice, plan, timing
        self.prefetch_bytes, self.kept_bytes = prefetch_bytes, kept_bytes
        self.sizes = {chunk: lookup(*chunk) for chunk in plan.chunks}
        self.limit = max(choice.budget_bytes, choice.predicted_peak_bytes)
        """The peak the budgets may reach: the budget, or for a budget out of reach the choice's peak."""
        self.backward = {chunk: plan.index(ActionKind.BACKWARD, *chunk) for chunk in plan.chunks}

    def policy(self, budgets: dict[tuple[int, int], int]) -> PlanPolicy:
        return PlanPolicy(self.plan, offload_groups=self.choice, prefetch_bytes=self.prefetch_bytes, chunk_reload_ahead=budgets)

    def simulated(self, budgets: dict[tuple[int, int], int]) -> Simulation:
        return simulate(self.plan, self.sizes, policy=self.policy(budgets), kept_bytes=self.kept_bytes)

    def with_room(self, fitted: dict[tuple[int, int], int], timed: dict[tuple[int, int], int], check: Simulation) -> dict[tuple[int, int], int]:
        """``fitted`` (within the limit, as ``check`` simulated it), and for the other chunks of
        ``timed`` the bytes their backward's room allows, where that waits less than one group
        ahead: a budget bounds the bytes reloaded ahead, so the peak there rises by at most that much."""
        peaks = _step_peaks(check.timeline_with)
        room = {chunk: min(nbytes, self.limit - peaks.get(self.backward[chunk], self.limit)) for chunk, nbytes in timed.items() if chunk not in fitted}
        partial = {chunk: nbytes for chunk, nbytes in room.items() if nbytes > 0}
        if not partial:
            return fitted
        before = self.policy(fitted).predicted_reload_waits(self.sizes, self.timing)
        after = self.policy({**fitted, **partial}).predicted_reload_waits(self.sizes, self.timing)
        partial = {chunk: nbytes for chunk, nbytes in partial.items() if after[chunk] < before[chunk]}
        if partial and self.simulated({**fitted, **partial}).peak_resident_bytes <= self.limit:
            return {**fitted, **partial}
        return fitted


def _step_peaks(timeline: Sequence[tuple[int, int]]) -> dict[int, int]:
    """Per plan step, the most bytes resident during it (from where the step before left them)."""
    peaks: dict[int, int] = {}
    now = 0
    for step, nbytes in timeline:
        peaks[step] = max(peaks.get(step, now), nbytes)
        now = nbytes
    return peaks
