"""`choose_offload` with a `CopyTiming`: the least exposed link time, then the fewest bytes.

A chunk's copied groups share the link inside the chunk's window (the compute between its
forward and its backward): alone on the link, the chunk exposes ``max(0, round trip of all its
copied bytes - window)`` seconds; chunks whose windows overlap also queue for it (NOTE [Link
queue], tests/schedule/test_budget_link_queue.py)."""

from __future__ import annotations

import itertools
import random

import pytest

from chunk_offload.schedule import CopyTiming, Plan, PlanPolicy, choose_offload, simulate
from chunk_offload.schedule._budget_link import Link
from chunk_offload.schedule.budget import _steps
from tests.schedule.test_budget_search import grouped, least, small_case

# LIFO: chunk 0's window runs from F1 to B0 (long), chunk 1's from F2 to B1 (short).
PLAN = Plan.from_order(["0F0", "0F1", "0F2", "0B2", "0B1", "0B0"], source="t")
SIZES = {(0, 0): [250], (1, 0): [100, 100], (2, 0): [150]}
# At 450 bytes the peak of 600 (F2's end) fits by chunk 0's group (250 bytes: F2 at 350, B1 at
# 200) or by both of chunk 1's (200 bytes: F2 at 400, B1 at 450); one of chunk 1's leaves F2 at
# 500, and chunk 2's copy comes too late for it. No prefetch, so B1 does not bring chunk 0 back.
BUDGET = 450
HIDES_ONE_BY_ONE = CopyTiming(bytes_per_s=100.0, action_starts_s=(0.0, 1.0, 2.0, 3.0, 4.0, 10.0), iteration_s=11.0)
"""100 B/s both ways. Chunk 0: 250 bytes out and back in 5 s of its 9. Chunk 1: each group's 2 s
fit its window of 2 s alone, both together take 4 s: 2 s exposed."""
NOTHING_HIDES = CopyTiming(
    bytes_per_s=100.0, reload_bytes_per_s=50.0, action_starts_s=(0.0, 1.0, 2.0, 3.0, 4.0, 8.0), iteration_s=11.0
)
"""Reloads at half the rate. Chunk 0: 2.5 + 5 s in a window of 7: 0.5 s exposed. Chunk 1: 2 + 4 s
in 2: 4 s exposed."""


def test_groups_of_one_chunk_share_its_window():
    """Each of chunk 1's groups hides alone; together they expose what their sum exceeds."""
    forward, backward = PLAN.index("F", 1, 0), PLAN.index("B", 1, 0)
    assert HIDES_ONE_BY_ONE.window_s(forward, backward) == 2.0
    assert HIDES_ONE_BY_ONE.exposed_s(forward, backward, 100) == 0.0
    assert HIDES_ONE_BY_ONE.exposed_s(forward, backward, 200) == 2.0
    assert NOTHING_HIDES.exposed_s(PLAN.index("F", 0, 0), PLAN.index("B", 0, 0), 250) == 0.5


@pytest.mark.parametrize(
    "timing, exposed", [(HIDES_ONE_BY_ONE, 0.0), (NOTHING_HIDES, 0.5)], ids=["hides-one-by-one", "nothing-hides"]
)
def test_least_exposed_time_before_fewest_bytes(timing, exposed):
    """Without timing the two groups of the short window (200 bytes); with it the large group of
    the long window (250 bytes), which exposes less link time."""
    fewest = choose_offload(PLAN, SIZES, BUDGET, prefetch_bytes=0)
    assert dict(fewest.offloaded) == {(1, 0): frozenset({0, 1})} and fewest.bytes_offloaded == 200
    assert fewest.exposed_s is None
    chosen = choose_offload(PLAN, SIZES, BUDGET, prefetch_bytes=0, timing=timing)
    assert dict(chosen.offloaded) == {(0, 0): frozenset({0})} and chosen.bytes_offloaded == 250
    assert chosen.exposed_s == exposed
    policy = PlanPolicy(PLAN, prefetch_bytes=0, offload_groups=chosen)
    simulated = simulate(PLAN, SIZES, policy=policy)
    assert simulated.peak_resident_bytes == chosen.predicted_peak_bytes == 350 <= BUDGET
    assert simulated.bytes_offloaded == 250
    assert choose_offload(PLAN, SIZES, BUDGET, prefetch_bytes=0, timing=timing) == chosen  # deterministic


def test_a_fitting_baseline_exposes_nothing():
    choice = choose_offload(PLAN, SIZES, 600, prefetch_bytes=0, timing=NOTHING_HIDES)
    assert choice.offloaded == {} and choice.exposed_s == 0.0


def test_the_optimum_on_small_cases():
    """Against every subset of groups (brute force, 12 groups), random action times and link
    rates: the least exposed seconds of the link queue, then the fewest bytes, in at least 3 cases
    of 4 (29 of 30 today), and never a choice that does not fit."""
    rng = random.Random(5)
    optimal = exposing = 0
    for _ in range(30):
        plan, sizes, budget = small_case(rng)
        starts = list(itertools.accumulate(rng.choice([0.5, 1.0, 2.0]) for _ in plan.actions[1:]))
        timing = CopyTiming(bytes_per_s=rng.choice([20.0, 50.0, 100.0]), action_starts_s=(0.0, *starts), iteration_s=starts[-1] + 1)
        best = least(plan, sizes, budget, lambda subset: queue_cost(plan, sizes, timing, subset))
        choice = choose_offload(plan, sizes, budget, timing=timing)
        got = (round(choice.exposed_s, 9), choice.bytes_offloaded)
        assert choice.fits and got >= best
        assert got == queue_cost(plan, sizes, timing, [(c, g) for c, gs in choice.offloaded.items() for g in gs])
        optimal += got == best
        exposing += best[0] > 0
    assert optimal == 29 and exposing >= 10  # enough cases where the link cannot hide it all


def copied_bytes(plan: Plan, sizes, subset) -> dict[tuple[int, int], int]:
    """Each chunk's copied bytes for a subset of (chunk, group)s, as `Link` takes them."""
    copied = grouped(subset)
    return {chunk: sum(sizes[chunk][g] for g in copied.get(chunk, ())) for chunk in plan.chunks}


def queue_cost(plan: Plan, sizes, timing: CopyTiming, subset) -> tuple[float, int]:
    """(exposed seconds of the link queue to the nanosecond, bytes) of a subset of (chunk, group)s."""
    exposed = Link(timing, _steps(plan), plan.chunks).total(copied_bytes(plan, sizes, subset))
    return round(exposed, 9), sum(sizes[c][g] for c, g in subset)


def chunk_cost(plan: Plan, sizes, timing: CopyTiming, subset) -> tuple[float, int]:
    """The same, each chunk alone on the link (`CopyTiming.exposed_s`): the model before the queue."""
    exposed = sum(
        timing.exposed_s(plan.index("F", *chunk), plan.index("B", *chunk), nbytes)
        for chunk, nbytes in copied_bytes(plan, sizes, subset).items()
    )
    return round(exposed, 9), sum(sizes[c][g] for c, g in subset)
