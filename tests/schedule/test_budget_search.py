"""The search behind `choose_offload`: its model of the accounting equals `simulate`, its choices
are minimal, close to the optimum on small cases, and it is fast on a 70B-like plan."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any, Callable

import pytest

from chunk_offload.core.actions import ActionKind
from chunk_offload.schedule import CopyTiming, Plan, PlanPolicy, choose_offload, megatron_plan, simulate
from chunk_offload.schedule._budget_link import Link
from chunk_offload.schedule._budget_search import model_peak
from chunk_offload.schedule.budget import _steps

PLANS = [
    *(megatron_plan(pp_size=4, pp_rank=r, num_microbatches=6) for r in range(4)),
    *(megatron_plan(pp_size=2, pp_rank=r, num_microbatches=4, vp_size=2) for r in range(2)),
    megatron_plan(pp_size=2, pp_rank=0, num_microbatches=6, vp_size=3, microbatch_group_size_per_vp_stage=3),
    Plan.from_order(["0F0", "0F1", "0B0", "0F2", "0B1", "0W0", "0B2", "0W1", "0W2"], source="zero bubble"),
]
BUDGETS = [(None, None), (0, None), (150, None), (10**9, None), (None, 120), (300, 1000)]


def _sizes(plan: Plan, rng: random.Random) -> dict[tuple[int, int], list[int]]:
    return {chunk: [rng.choice([0, 1, 50, 100, 300, 1000]) for _ in range(rng.randint(0, 6))] for chunk in plan.chunks}


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.source}-{p.pp_rank}")
def test_model_equals_simulate(plan):
    """The search's position model gives simulate's peak for any choice and reload budgets
    (kept and empty groups anywhere, prefetch and reload-ahead budgets, weight steps)."""
    rng = random.Random(plan.pp_rank)
    for _ in range(30):
        sizes = _sizes(plan, rng)
        copied = {chunk: {g for g in range(len(b)) if rng.random() < 0.5} for chunk, b in sizes.items()}
        for prefetch, ahead in BUDGETS:
            policy = PlanPolicy(plan, prefetch_bytes=prefetch, reload_ahead_bytes=ahead, offload_groups=copied)
            expected = simulate(plan, sizes, policy=policy).peak_resident_bytes
            assert model_peak(plan, sizes, copied, prefetch_bytes=prefetch, reload_ahead_bytes=ahead) == expected


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.source}-{p.pp_rank}")
def test_choices_fit_and_are_minimal(plan):
    """Every budget from the lowest peak up is met, and keeping any one chosen group on device
    again would break it (the pruning pass)."""
    rng = random.Random(10 + plan.pp_rank)
    for _ in range(6):
        sizes = _sizes(plan, rng)
        for prefetch, ahead in BUDGETS[:3] + BUDGETS[4:5]:
            low = choose_offload(plan, sizes, 0, prefetch_bytes=prefetch, reload_ahead_bytes=ahead)
            budget = rng.randint(low.lowest_peak_bytes, max(low.baseline_peak_bytes, low.lowest_peak_bytes))
            choice = choose_offload(plan, sizes, budget, prefetch_bytes=prefetch, reload_ahead_bytes=ahead)
            assert choice.fits and choice.lowest_peak_bytes == low.lowest_peak_bytes
            for chunk, groups in choice.offloaded.items():
                for g in groups:
                    fewer = {c: set(gs) - ({g} if c == chunk else set()) for c, gs in choice.offloaded.items()}
                    assert model_peak(plan, sizes, fewer, prefetch_bytes=prefetch, reload_ahead_bytes=ahead) > budget


def test_close_to_the_optimum_on_small_cases():
    """Against every subset of groups (brute force, up to 12 groups): never more than 1.5x the
    fewest bytes that fit, and the optimum in most cases."""
    rng = random.Random(5)
    optimal = cases = 0
    for _ in range(30):
        plan, sizes, budget = small_case(rng)
        best = least(plan, sizes, budget, lambda subset: sum(sizes[c][g] for c, g in subset))
        choice = choose_offload(plan, sizes, budget)
        assert choice.fits and choice.bytes_offloaded <= 1.5 * best
        optimal += choice.bytes_offloaded == best
        cases += 1
    assert optimal >= 0.75 * cases


def small_case(rng: random.Random) -> tuple[Plan, dict[tuple[int, int], list[int]], int]:
    """A small plan (6 chunks of 3 groups), its sizes and a budget between its lowest and baseline peaks."""
    plan = rng.choice(_SMALL_PLANS)
    sizes = {chunk: [rng.choice([10, 30, 50, 100]) for _ in range(3)] for chunk in plan.chunks}
    everything = choose_offload(plan, sizes, 0)
    return plan, sizes, rng.randint(everything.lowest_peak_bytes, everything.baseline_peak_bytes)


def least(plan: Plan, sizes: dict[tuple[int, int], list[int]], budget: int, cost: Callable[[tuple], Any]) -> Any:
    """The least ``cost`` of a subset of (chunk, group)s whose peak fits ``budget`` (brute force)."""
    keys = [(chunk, g) for chunk in plan.chunks for g in range(len(sizes[chunk]))]
    return min(
        cost(subset)
        for k in range(len(keys) + 1)
        for subset in itertools.combinations(keys, k)
        if model_peak(plan, sizes, grouped(subset)) <= budget
    )


_SMALL_PLANS = [megatron_plan(pp_size=3, pp_rank=0, num_microbatches=3), megatron_plan(pp_size=2, pp_rank=0, num_microbatches=2, vp_size=2)]


def test_a_large_group_gives_way_to_a_cheaper_one_on_the_peak():
    """Additions and pruning alone copy groups 1 and 2 of chunk 1 (130 bytes), each needed once
    the other is copied; one group of chunk 2, on host at the same peak, meets the budget with
    100 (the swap pass: keep one chosen group on device, cover the excess with cheaper ones)."""
    plan = megatron_plan(pp_size=3, pp_rank=0, num_microbatches=3)
    sizes = {(0, 0): [100, 50, 50], (1, 0): [10, 100, 30], (2, 0): [100, 100, 100]}
    assert model_peak(plan, sizes, {(1, 0): {1, 2}}) <= 559 and model_peak(plan, sizes, {(1, 0): {1}}) > 559
    choice = choose_offload(plan, sizes, 559)
    assert dict(choice.offloaded) == {(2, 0): frozenset({0})} and choice.bytes_offloaded == 100
    simulated = simulate(plan, sizes, policy=PlanPolicy(plan, offload_groups=choice))
    assert simulated.peak_resident_bytes == choice.predicted_peak_bytes == 540 <= 559 < simulated.peak_saved_bytes == 640


def grouped(subset) -> dict[tuple[int, int], set[int]]:
    out: dict[tuple[int, int], set[int]] = {}
    for chunk, g in subset:
        out.setdefault(chunk, set()).add(g)
    return out


@pytest.mark.parametrize("link_bytes_per_s", [None, 2e9], ids=["bytes", "link-time"])
def test_fast_on_a_70b_like_plan(link_bytes_per_s):
    """PP=8, 32 microbatches, VPP=2, 5 layers of 10 groups per chunk (3,200 groups on rank 0); with
    a timing (forwards 10 ms, backwards 20 ms, 2 GB/s each way: the copies of many chunks cannot
    hide whole) the choice exposes less link time than the fewest-bytes one, in a few seconds of CPU."""
    layer = [16, 48, 64, 16, 16, 16, 64, 64, 32, 8]
    sizes = {vp: [b << 20 for b in layer * 5] for vp in range(2)}
    first, last = (megatron_plan(pp_size=8, pp_rank=r, num_microbatches=32, vp_size=2) for r in (0, 7))
    budget = (simulate(first, sizes, offload=False).peak_saved_bytes + simulate(last, sizes, offload=False).peak_saved_bytes) // 2
    timing = None
    if link_bytes_per_s is not None:
        starts = itertools.accumulate((0.010 if a.kind is ActionKind.FORWARD else 0.020 for a in first.actions[:-1]), initial=0.0)
        timing = CopyTiming(bytes_per_s=link_bytes_per_s, action_starts_s=tuple(starts), iteration_s=1.0)
    started = time.process_time()
    choice = choose_offload(first, sizes, budget, timing=timing)
    seconds = time.process_time() - started
    assert choice.fits and 0 < choice.bytes_offloaded
    assert seconds < 5, f"choose_offload took {seconds:.2f} s of CPU"
    if timing is not None:
        fewest = choose_offload(first, sizes, budget)
        moved = {chunk: sum(sizes[chunk[1]][g] for g in fewest.offloaded.get(chunk, ())) for chunk in first.chunks}
        exposed = Link(timing, _steps(first), first.chunks).total(moved)  # on the link queue, NOTE [Link queue]
        assert choice.exposed_s < exposed and choice.bytes_offloaded > fewest.bytes_offloaded
