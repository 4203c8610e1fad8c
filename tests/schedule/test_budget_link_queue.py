"""The link queue behind `choose_offload` with a `CopyTiming` (NOTE [Link queue]): chunks whose
windows overlap queue for the link; where none do, each chunk exposes what it would alone."""

from __future__ import annotations

import hashlib
import itertools
import random

import numpy as np
import pytest

from chunk_offload.schedule import CopyTiming, Plan, choose_offload, megatron_plan
from chunk_offload.schedule._budget_link import Link
from chunk_offload.schedule._budget_search import model_peak
from chunk_offload.schedule.budget import _steps
from tests.schedule.test_budget_link_time import chunk_cost, copied_bytes, queue_cost
from tests.schedule.test_budget_search import BUDGETS, PLANS, _sizes, grouped

# Zero bubble: chunk 0's window is F1 (to B0), chunk 1's B0 and F2 (to B1), chunk 2's B1 and W0 (to
# B2); they touch, never overlap. 1F1B-like: the three windows overlap, each two actions long.
APART = Plan.from_order(["0F0", "0F1", "0B0", "0F2", "0B1", "0W0", "0B2", "0W1", "0W2"], source="zero bubble")
OVERLAPPING = Plan.from_order(["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"], source="1F1B")


def _link(plan: Plan, timing: CopyTiming) -> Link:
    return Link(timing, _steps(plan), plan.chunks)


def _alone(plan: Plan, timing: CopyTiming, moved: dict) -> dict:
    """Each chunk's `CopyTiming.exposed_s`: the per-chunk model."""
    return {c: timing.exposed_s(plan.index("F", *c), plan.index("B", *c), m) if m else 0.0 for c, m in moved.items()}


def test_windows_apart_expose_what_each_chunk_would_alone():
    """Random rates, action times and bytes, waits included (a chunk exposed delays the next
    one's window as much as its own): every chunk's exposure and the sum are bitwise the per-chunk
    model's."""
    rng = random.Random(3)
    waited = 0
    for _ in range(200):
        starts = tuple(itertools.accumulate((rng.choice([0.25, 0.5, 1.0, 1.5, 3.0]) for _ in APART.actions[1:]), initial=0.0))
        back = rng.choice([None, 30.0, 70.0])
        timing = CopyTiming(bytes_per_s=rng.choice([20.0, 50.0, 100.0]), reload_bytes_per_s=back, action_starts_s=starts, iteration_s=9.0)
        moved = {chunk: rng.choice([0, 10, 30, 50, 100, 300]) for chunk in APART.chunks}
        alone = _alone(APART, timing, moved)
        link = _link(APART, timing)
        assert link.exposures(moved) == alone
        assert link.total(moved) == sum(alone.values(), 0.0)
        waited += sum(1 for seconds in alone.values() if seconds > 0) > 1
    assert waited >= 50  # several chunks exposed in one choice


@pytest.mark.parametrize(
    "nbytes, back_rate, exposures, alone",
    [
        # 1.25 s out, 0.75 s back in windows of 2 s: each hides alone. On the link, chunk 1's
        # offload waits for chunk 0's (2.25 to 3.5), its reload ends at 4.25 for B1 at 4; chunk 2's
        # offload (entering at 3) waits to 3.5+1.25 = 4.75, its reload ends at 5.5 for B2 at 5.25.
        (60, 80.0, (0.0, 0.25, 0.25), (0.0, 0.0, 0.0)),
        # 1.5 s each way, windows of 2 s: each chunk alone exposes 1 s. On the link chunk 0's
        # reload ends at 4 (B0 at 3: 1 s, every later start 1 s later), chunk 1's at 5.5 (B1 at
        # 5: 0.5 s), chunk 2's offload enters at B0's late start, 4, its reload ends at 7 (B2 at
        # 6.5: 0.5 s): the wait for chunk 0 gave the others time.
        (72, 48.0, (1.0, 0.5, 0.5), (1.0, 1.0, 1.0)),
    ],
    ids=["queue-exposes-more", "a-wait-lets-the-queue-catch-up"],
)
def test_overlapping_windows_by_hand(nbytes, back_rate, exposures, alone):
    """F0 F1 F2 B0 B1 B2, one second each; every chunk copies ``nbytes``, out at 48 B/s."""
    timing = CopyTiming(bytes_per_s=48.0, reload_bytes_per_s=back_rate, action_starts_s=(0.0, 1.0, 2.0, 3.0, 4.0, 5.0), iteration_s=6.0)
    moved = dict.fromkeys(OVERLAPPING.chunks, nbytes)
    link = _link(OVERLAPPING, timing)
    assert tuple(_alone(OVERLAPPING, timing, moved).values()) == alone
    assert tuple(link.exposures(moved).values()) == exposures
    assert link.total(moved) == sum(exposures)


def test_what_a_change_adds_is_the_difference_of_totals():
    """`Link.added_each` (arrays, one walk) and `Link.added` give the change of `Link.total` that
    changing one chunk's bytes makes (to the nanosecond), and exactly 0.0 for no change."""
    rng = random.Random(11)
    for plan in PLANS:
        starts = tuple(itertools.accumulate((rng.choice([0.5, 1.0, 2.0]) for _ in plan.actions[1:]), initial=0.0))
        timing = CopyTiming(bytes_per_s=40.0, reload_bytes_per_s=rng.choice([None, 25.0]), action_starts_s=starts, iteration_s=starts[-1] + 1)
        link = _link(plan, timing)
        moved = {chunk: rng.choice([0, 10, 50, 100]) for chunk in plan.chunks}
        chunks = np.array([rng.randrange(len(plan.chunks)) for _ in range(12)])
        change = np.array([max(rng.choice([-100, -10, 0, 10, 100]), -moved[plan.chunks[k]]) for k in chunks])
        each = link.added_each(moved, chunks, change)
        for k, c, seconds in zip(chunks.tolist(), change.tolist(), each.tolist()):
            after = dict(moved)
            after[plan.chunks[k]] += c
            assert round(seconds, 9) == round(_link(plan, timing).total(after) - link.total(moved), 9)
            assert _link(plan, timing).added(moved, k, c) == seconds
            assert seconds == 0.0 if c == 0 else (seconds >= 0.0 if c > 0 else seconds <= 0.0)  # more bytes never expose less


def test_the_queue_choice_exposes_less_than_the_per_chunk_choice():
    """A 2-stage interleaved rank: the fewest seconds of the per-chunk model (brute force: 0.3 s)
    copy groups of four chunks whose windows overlap, which on the link queue expose 2.5 s; the
    choice exposes 1.2 s on it (0.6 s by the per-chunk model), also the brute-force optimum."""
    plan = megatron_plan(pp_size=2, pp_rank=0, num_microbatches=2, vp_size=2)
    sizes = {(0, 0): [10, 10, 100], (1, 0): [100, 100, 30], (0, 1): [10, 30, 30], (1, 1): [30, 10, 100]}
    timing = CopyTiming(bytes_per_s=100.0, action_starts_s=(0.0, 2.0, 2.5, 3.0, 3.5, 4.0, 6.0, 6.5), iteration_s=7.5)
    keys = [(chunk, g) for chunk in plan.chunks for g in range(3)]
    fits = [s for k in range(len(keys) + 1) for s in itertools.combinations(keys, k) if model_peak(plan, sizes, grouped(s)) <= 253]
    per_chunk = min(fits, key=lambda s: chunk_cost(plan, sizes, timing, s))
    assert sorted(per_chunk) == [((0, 0), 0), ((0, 0), 2), ((1, 0), 0), ((1, 0), 1), ((1, 1), 0), ((1, 1), 1)]
    assert chunk_cost(plan, sizes, timing, per_chunk) == (0.3, 350) and queue_cost(plan, sizes, timing, per_chunk) == (2.5, 350)
    choice = choose_offload(plan, sizes, 253, timing=timing)
    chosen = [(chunk, g) for chunk, groups in choice.offloaded.items() for g in groups]
    assert dict(choice.offloaded) == {(0, 0): frozenset({0, 2}), (1, 0): frozenset({0, 1, 2})} and choice.fits
    assert queue_cost(plan, sizes, timing, chosen) == (1.2, 340) == min(queue_cost(plan, sizes, timing, s) for s in fits)
    assert round(choice.exposed_s, 9) == 1.2 and chunk_cost(plan, sizes, timing, chosen) == (0.6, 340)
    assert _link(plan, timing).total(copied_bytes(plan, sizes, chosen)) == choice.exposed_s


def test_choices_without_timing_are_unchanged():
    """400 choices without a `CopyTiming` (random plans, sizes, budgets, prefetch and reload-ahead
    budgets): the digest of their groups and peaks taken before the link queue."""
    rng = random.Random(2024)
    digest = hashlib.sha256()
    for n in range(400):
        plan = PLANS[n % len(PLANS)]
        sizes = _sizes(plan, rng)
        prefetch, ahead = BUDGETS[rng.randrange(len(BUDGETS))]
        low = choose_offload(plan, sizes, 0, prefetch_bytes=prefetch, reload_ahead_bytes=ahead)
        budget = rng.randint(low.lowest_peak_bytes, max(low.baseline_peak_bytes, low.lowest_peak_bytes))
        choice = choose_offload(plan, sizes, budget, prefetch_bytes=prefetch, reload_ahead_bytes=ahead)
        digest.update(repr((sorted((k, sorted(v)) for k, v in choice.offloaded.items()), choice.predicted_peak_bytes)).encode())
    assert digest.hexdigest() == "e2990d22616ed18f5bc1ee5455a1bc77451e62dee1c22f36e763a78d57a36e62"
