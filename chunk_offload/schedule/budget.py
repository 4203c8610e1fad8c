"""Device budget: which groups of which chunks a rank copies to host so that its peak fits.

`choose_offload` takes the rank's plan, the saved bytes of every group (measured by a baseline
iteration, `IterationRecord.group_bytes`, or predicted by the planner) and a budget for the
device-resident saved bytes, and returns an `OffloadChoice`: the groups to copy, down to single
groups of single chunks, with the peak `simulate` predicts for them. `PlanPolicy(plan,
offload_groups=choice)` makes the engine apply it. `level_budget` is the budget every rank of a
pipeline can meet ('auto'), `budget_shortfall_message` the error or warning for a rank that
cannot meet its budget, `budget_exceeded_message` the warning for a measured peak above it.

NOTE [Budget choice]
A rank whose baseline peak fits offloads nothing. Otherwise the choice meets the budget at the
least cost. Without timing the cost is the bytes copied. With a `CopyTiming` it is the link
time compute does not hide, then bytes: every chunk's copied bytes go out after its forward and
come back before its backward through one queue per direction that all chunks share, and a
choice exposes the delay those queues add to the run (NOTE [Link queue], `_budget_link.Link`,
compared to the nanosecond). A chunk alone on the link exposes ``max(0, round trip - window)``
(`CopyTiming.exposed_s`, the window from the action after its forward to its backward); chunks
whose windows overlap (every pipeline stage) may wait for each other's copies. A group's cost is
what adding it adds to the whole choice's exposure: none while the copies still hide.
Starting from nothing offloaded, while the predicted peak exceeds the budget, a unit is added
at the moment of the peak: a group live then that would be on host at that moment if copied
(or such a group with the cheapest group above it in its chunk, when alone it would be the one
its chunk's prefetch brings back). Two rules pick the unit: "peak" (if one unit alone covers
the excess, the cheapest such, else the one lowering the peak most) and "reach" (the most
excess removed per byte over the unit's whole time on host, so one copy lowers several later
peaks). Units whose copy hides behind compute come first under both (with timing: adding no
exposed seconds; without, a longer lifespan in actions); with timing "cheapest" is the fewest
exposed seconds, then bytes, and units that do not hide rank by excess removed per exposed
second instead of per byte. Each result, and every group copied, is then pruned: a group is
kept on device again wherever the peak still fits without it, largest first (with timing, the
one whose return gives back the most exposed seconds first, re-ranked as its chunk changes).
The cheapest result is taken, then swapped (`_Search.swap`): each of its costliest groups in
turn (the largest; with timing, the most exposed seconds first) is kept on device and the excess it leaves covered by additions at the
peak (cheapest covering first), then pruned; a cheaper swap is taken. Pruning alone leaves every
chosen group needed, but a large group may still cost more than the smaller ones at the same
peak. Groups that saved one storage (``shared``) are added and kept back together: a copy of
only some of them frees nothing (NOTE [Storages held elsewhere]). The peak is `simulate`'s,
prefetch and reload-ahead budgets included (the search runs on an exact model of it,
`_budget_search`; the final choice is simulated). Deterministic; on a 70B-like plan (PP=8,
VPP=2, 32 microbatches, 3,200 groups) under a second of CPU without timing, about two with.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..core.actions import ActionKind
from ..core.errors import ChunkOffloadError, internal_assert
from ._budget_link import Link
from ._budget_search import search_offload
from .choice import CopyTiming, OffloadChoice
from .plan import Plan
from .plan_policy import PlanPolicy
from .simulate import GroupBytes, _lookup, simulate

__all__ = [
    "CopyTiming",
    "OffloadChoice",
    "budget_exceeded_message",
    "budget_shortfall_message",
    "choose_offload",
    "level_budget",
]


def choose_offload(
    plan: Plan,
    group_bytes: GroupBytes,
    budget_bytes: int,
    *,
    prefetch_bytes: int | None = None,
    reload_ahead_bytes: int | None = None,
    timing: CopyTiming | None = None,
    kept_bytes: GroupBytes | None = None,
    shared: Mapping[tuple[int, int], Sequence[Sequence[int]]] | None = None,
) -> OffloadChoice:
    """The fewest bytes to copy so that ``plan``'s predicted peak fits ``budget_bytes``; with
    ``timing``, the least link time not hidden by compute, then the fewest bytes.

    See NOTE [Budget choice]. ``group_bytes`` and ``kept_bytes`` as `simulate` takes them; ``prefetch_bytes`` and
    ``reload_ahead_bytes`` as the `PlanPolicy` that will apply the choice. ``shared``: per chunk, the
    sets of groups that saved one storage (`IterationRecord.group_shared`), copied together or not at all. Never raises for a
    budget below the lowest reachable peak: returns the choice reaching that peak with the
    fewest bytes, ``fits`` False (`budget_shortfall_message` words it).
    """
    if not isinstance(plan, Plan):
        raise ChunkOffloadError(f"choose_offload needs a chunk_offload.schedule.Plan, got {type(plan).__name__}")
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0:
        raise ChunkOffloadError(f"chunk_offload: budget_bytes must be an int >= 0 (bytes), got {budget_bytes!r}")
    PlanPolicy.check_budgets(prefetch_bytes=prefetch_bytes, reload_ahead_bytes=reload_ahead_bytes)
    if timing is not None and len(timing.action_starts_s) != len(plan.actions):
        raise ChunkOffloadError(
            f"chunk_offload: timing has {len(timing.action_starts_s)} action starts, the plan has {len(plan.actions)} actions; "
            "build it with CopyTiming.from_record(record, plan)"
        )
    lookup = _lookup(group_bytes)
    sizes = {chunk: lookup(*chunk) for chunk in plan.chunks}
    kept = None
    if kept_bytes is not None:  # bytes each group keeps on device even when copied (simulate's kept_bytes)
        kept_lookup = _lookup(kept_bytes)
        kept = {chunk: kept_lookup(*chunk) for chunk in plan.chunks}
    found = search_offload(
        plan,
        sizes,
        budget_bytes,
        prefetch_bytes=prefetch_bytes,
        reload_ahead_bytes=reload_ahead_bytes,
        slack=_slack(plan, sizes, timing),
        kept=kept,
        shared=shared,
        link=None if timing is None else Link(timing, _steps(plan), plan.chunks),
    )
    # The search works on a model of simulate's accounting; the choice is checked by simulate itself.
    policy = PlanPolicy(plan, prefetch_bytes=prefetch_bytes, reload_ahead_bytes=reload_ahead_bytes, offload_groups=found.offloaded)
    predicted = simulate(plan, sizes, policy=policy, kept_bytes=kept)
    internal_assert(
        predicted.peak_resident_bytes == found.peak and predicted.peak_saved_bytes == found.baseline_peak,
        f"choose_offload: the search's peak {found.peak} differs from simulate's {predicted.peak_resident_bytes}",
    )
    return OffloadChoice(
        budget_bytes=budget_bytes,
        offloaded=found.offloaded,
        predicted_peak_bytes=predicted.peak_resident_bytes,
        baseline_peak_bytes=predicted.peak_saved_bytes,
        lowest_peak_bytes=found.lowest_peak,
        bytes_offloaded=predicted.bytes_offloaded,
        exposed_s=found.exposed_s,
    )


def _steps(plan: Plan) -> dict[tuple[int, int], tuple[int, int]]:
    """Per chunk: the plan indices of its forward and its backward."""
    step = {(a.kind, a.chunk): i for i, a in enumerate(plan.actions)}
    return {chunk: (step[(ActionKind.FORWARD, chunk)], step[(ActionKind.BACKWARD, chunk)]) for chunk in plan.chunks}


def _slack(plan: Plan, sizes: Mapping[tuple[int, int], Sequence[int]], timing: CopyTiming | None) -> dict[tuple[int, int], list[float]]:
    """Per group: how well its copy hides (>= 0: hides; larger: better): with ``timing`` the
    compute seconds left over its copy out and back, else the chunk's lifespan in actions - 1."""
    steps = _steps(plan)
    out = {}
    for chunk, bs in sizes.items():
        forward, backward = steps[chunk]
        if timing is None:
            out[chunk] = [float(backward - forward - 2)] * len(bs)  # the lifespan - 1
        else:
            out[chunk] = [timing.slack_s(forward, backward, b) for b in bs]
    return out


_REACH_HINT = (
    "offload more modules (--chunk-offload-modules), recompute activations (--recompute-granularity), "
    "use a smaller micro batch or fewer microbatches in flight, or raise the budget"
)
"""What lowers a stage's saved bytes beyond what offloading the chosen modules reaches."""


def budget_shortfall_message(choice: OffloadChoice, *, rank: int) -> str:
    """The error or warning for a rank whose budget cannot be met: rank, budget, lowest peak, the
    bytes missing and what would reach it."""
    return (
        f"chunk_offload: pipeline rank {rank}: device_budget_bytes {_size(choice.budget_bytes)} cannot be met: the "
        f"lowest peak reachable is {_size(choice.lowest_peak_bytes)} (every group offloaded; without offload "
        f"{_size(choice.baseline_peak_bytes)}), {choice.lowest_peak_bytes - choice.budget_bytes} bytes over; to reach it, "
        f"{_REACH_HINT} (to at least {choice.lowest_peak_bytes} bytes, or 'auto')"
    )


def budget_exceeded_message(*, rank: int, budget_bytes: int, peak_bytes: int) -> str:
    """The warning for a rank whose measured peak exceeded a budget the choice was predicted to meet."""
    return (
        f"chunk_offload: pipeline rank {rank}: device_budget_bytes {_size(budget_bytes)} was not met: the iteration "
        f"peaked at {_size(peak_bytes)}, {peak_bytes - budget_bytes} bytes over; to reach it, {_REACH_HINT}"
    )


def level_budget(lowest_peaks: Sequence[int]) -> int:
    """'auto': the smallest budget every rank can meet, the largest of their lowest peaks."""
    peaks = list(lowest_peaks)
    if not peaks or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in peaks):
        raise ChunkOffloadError(f"chunk_offload: lowest_peaks must be a non-empty sequence of ints >= 0, got {peaks!r}")
    return max(peaks)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"
