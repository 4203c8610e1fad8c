"""`fit_reload_ahead`: a device budget's choice reloads ahead by a timing only where its peak still
fits; `choose_with_reload_ahead`: a choice that leaves room for it (NOTE [Reload room]).

Stage 0 of PP=2 with 4 microbatches (0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3), groups of 100, 10 and 10
bytes, each forward 1 s and each backward 3 s, 40 B/s back: one group ahead, a 100-byte reload
(2.5 s) waits behind the small group's backward, so the timing asks for 110 bytes ahead where
the large group is copied.
"""

from __future__ import annotations

import dataclasses

import pytest

from chunk_offload import ChunkOffloadError
from chunk_offload.core import ActionKind, ChunkKey
from chunk_offload.schedule import (
    CopyTiming,
    PlanPolicy,
    choose_offload,
    choose_with_reload_ahead,
    fit_reload_ahead,
    megatron_plan,
    simulate,
)
from chunk_offload.schedule import budget_reload as budget_module

PLAN = megatron_plan(pp_size=2, pp_rank=0, num_microbatches=4)
SIZES = {0: [100, 10, 10]}


def _timing(plan=PLAN, reload_bytes_per_s: float = 40.0) -> CopyTiming:
    starts, now = [], 0.0
    for action in plan.actions:
        starts.append(now)
        now += 3.0 if action.kind is ActionKind.BACKWARD else 1.0
    return CopyTiming(bytes_per_s=1000.0, reload_bytes_per_s=reload_bytes_per_s, action_starts_s=starts, iteration_s=now)


def _peak(choice, budgets) -> int:
    return simulate(PLAN, SIZES, policy=PlanPolicy(PLAN, offload_groups=choice, chunk_reload_ahead=budgets)).peak_resident_bytes


def test_every_budget_when_the_peak_still_fits():
    timing = _timing()
    choice = choose_offload(PLAN, SIZES, 220, timing=timing)
    derived = PlanPolicy(PLAN, offload_groups=choice).reload_ahead_from(SIZES, timing)
    assert derived == {(1, 0): 110, (2, 0): 110} and _peak(choice, derived) == 230
    roomy = dataclasses.replace(choice, budget_bytes=230)
    assert fit_reload_ahead(roomy, PLAN, SIZES, timing) == derived


def test_chunks_in_backward_order_while_the_peak_fits():
    """At 220 bytes the second chunk's budget would raise the peak by 10 bytes: only 0B1's chunk
    reloads ahead. At 130 bytes (the large group of every chunk copied), 0B2's would."""
    timing = _timing()
    tight = choose_offload(PLAN, SIZES, 220, timing=timing)
    assert tight.predicted_peak_bytes == 220
    assert fit_reload_ahead(tight, PLAN, SIZES, timing) == {(1, 0): 110}
    assert _peak(tight, {(1, 0): 110}) == 220 < _peak(tight, {(2, 0): 110})
    low = choose_offload(PLAN, SIZES, 130, timing=timing)
    assert low.offloaded == {chunk: frozenset({0, 1}) for chunk in PLAN.chunks} and low.predicted_peak_bytes == 130
    assert fit_reload_ahead(low, PLAN, SIZES, timing) == {(0, 0): 110, (1, 0): 110, (3, 0): 110}
    assert _peak(low, {(0, 0): 110, (1, 0): 110, (3, 0): 110}) == 130 < _peak(low, {(0, 0): 110, (1, 0): 110, (2, 0): 110, (3, 0): 110})


def test_a_budget_out_of_reach_keeps_the_choices_peak():
    """A choice that does not fit its budget (here the 130-byte choice asked for 100): the
    budgets may not raise its predicted peak, the lowest it reaches."""
    timing = _timing()
    short = dataclasses.replace(choose_offload(PLAN, SIZES, 130, timing=timing), budget_bytes=100)
    assert not short.fits
    assert fit_reload_ahead(short, PLAN, SIZES, timing) == {(0, 0): 110, (1, 0): 110, (3, 0): 110}


def test_the_policy_takes_per_chunk_budgets_and_checks_them():
    choice = choose_offload(PLAN, SIZES, 130)
    policy = PlanPolicy(PLAN, offload_groups=choice, chunk_reload_ahead={(1, 0): 110})
    assert [policy.reload_ahead_bytes(ChunkKey(m, 0)) for m in range(4)] == [None, 110, None, None]
    with pytest.raises(ChunkOffloadError, match=r"chunk_reload_ahead\[\(1, 0\)\] must be an int number of bytes >= 0 or None, got -1"):
        PlanPolicy(PLAN, offload_groups=choice, chunk_reload_ahead={(1, 0): -1})


def test_one_simulation_finds_the_chunks_and_a_second_checks_them(monkeypatch):
    """A chunk's budget raises the peak only during its own backward, so the backwards' peaks of
    one simulation with every budget pick the chunks (two simulations in all); were that pick
    over the budget, chunks are tried one at a time (forced here by hiding the backwards' peaks)."""
    timing = _timing()
    tight = choose_offload(PLAN, SIZES, 220, timing=timing)
    calls = []
    real = budget_module.simulate
    monkeypatch.setattr(budget_module, "simulate", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert fit_reload_ahead(tight, PLAN, SIZES, timing) == {(1, 0): 110} and len(calls) == 2
    monkeypatch.setattr(budget_module, "_step_peaks", lambda timeline: {})
    calls.clear()
    assert fit_reload_ahead(tight, PLAN, SIZES, timing) == {(1, 0): 110} and len(calls) == 2 + 2


# PP=1 with 2 microbatches (F0 B0 F1 B1), small and large groups alternating (10 and 100 bytes),
# each backward 3 s spread over the groups by bytes (30/440 s per small group, 300/440 per large),
# 200 B/s back: a large reload takes 0.5 s, longer than a small group's backward.
PP1 = megatron_plan(pp_size=1, pp_rank=0, num_microbatches=2)
LAYERS = {0: [10, 100] * 4}


def test_a_choice_made_lower_leaves_room_to_reload_ahead_at_pp1():
    """Under 240 bytes the choice copies the large groups 1 and 3 and keeps 5 and 7 (4 x 10 + 200
    bytes at each backward's start): no room. One group ahead, the reloads of 3 and 1 start as the
    small groups 4 and 2 compute, and wait 0.5 - 30/440 s each, in both chunks. Made for 140 bytes
    (240 less the 100 the reloads ahead overshot), the choice copies 5 too: 140 bytes at the
    backward's start, and 100 bytes ahead start each large reload with the large group two after
    it: no wait, peak 240, within the budget."""
    timing = _timing(PP1, 200.0)
    assert choose_offload(PP1, LAYERS, 240, timing=timing).offloaded == {chunk: frozenset({1, 3}) for chunk in PP1.chunks}
    assert fit_reload_ahead(choose_offload(PP1, LAYERS, 240, timing=timing), PP1, LAYERS, timing) == {}
    timed = choose_with_reload_ahead(PP1, LAYERS, 240, timing)
    assert timed.choice.offloaded == {chunk: frozenset({1, 3, 5}) for chunk in PP1.chunks}
    assert timed.choice.budget_bytes == 240 and timed.choice.predicted_peak_bytes == 140 and timed.made_for_bytes == 140
    assert timed.chunk_reload_ahead == {(0, 0): 100, (1, 0): 100}
    assert timed.predicted_wait_s == 0.0
    assert timed.budget_choice_wait_s == pytest.approx(4 * (0.5 - 3.0 * 10 / 440), rel=1e-12)
    policy = PlanPolicy(PP1, offload_groups=timed.choice, chunk_reload_ahead=timed.chunk_reload_ahead)
    assert simulate(PP1, LAYERS, policy=policy).peak_resident_bytes == 240


def test_the_choice_made_for_the_budget_is_kept_where_it_waits_least(monkeypatch):
    """Where the choice made for the budget leaves no reload waiting (the PP=2 plan above under
    230 bytes copies the small groups alone), it is taken after one search; where no lower
    choice waits less (the 40 B/s link at PP=1: each large reload waits whatever the choice),
    it is taken after the lower ones were tried."""
    calls = []
    real = budget_module.choose_offload
    monkeypatch.setattr(budget_module, "choose_offload", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    roomy = choose_with_reload_ahead(PLAN, SIZES, 230, _timing())
    assert calls == [230] and roomy.made_for_bytes == 230 and roomy.chunk_reload_ahead == {} and roomy.predicted_wait_s == 0.0
    assert roomy.choice == choose_offload(PLAN, SIZES, 230, timing=_timing())
    calls.clear()
    slow = choose_with_reload_ahead(PP1, LAYERS, 240, _timing(PP1, 40.0))
    assert len(calls) > 1 and slow.made_for_bytes == 240 and slow.predicted_wait_s == slow.budget_choice_wait_s > 0


def test_a_budget_out_of_reach_is_not_lowered():
    timing = _timing(PP1, 200.0)
    lowest = choose_offload(PP1, LAYERS, 0).lowest_peak_bytes
    short = choose_with_reload_ahead(PP1, LAYERS, lowest - 1, timing)
    assert not short.choice.fits and short.made_for_bytes == lowest - 1


def test_a_chunk_without_room_for_its_whole_budget_reloads_ahead_what_fits():
    """Stage 0 of PP=2, groups of 50 and 10 bytes alternating, 40 B/s back, under 170 bytes: the
    last chunk's timed budget (70 bytes) would raise its backward's peak; 60 fit, and wait less
    than one group ahead."""
    sizes, timing = {0: [50, 10] * 3}, _timing()
    choice = choose_offload(PLAN, sizes, 170, timing=timing)
    whole = PlanPolicy(PLAN, offload_groups=choice).reload_ahead_from(sizes, timing)
    fitted = fit_reload_ahead(choice, PLAN, sizes, timing)
    assert whole[(3, 0)] == 70 and fitted[(3, 0)] == 60
    assert simulate(PLAN, sizes, policy=PlanPolicy(PLAN, offload_groups=choice, chunk_reload_ahead=fitted)).peak_resident_bytes <= 170
    without = {chunk: nbytes for chunk, nbytes in fitted.items() if chunk != (3, 0)}
    waits = [PlanPolicy(PLAN, offload_groups=choice, chunk_reload_ahead=b).predicted_reload_waits(sizes, timing)[(3, 0)] for b in (fitted, without)]
    assert waits[0] < waits[1]


def test_a_chunk_whose_backward_follows_at_once_waits_for_its_last_copies_to_host():
    """PP=1, groups of 100 and 10 bytes, the first copied: its copy to host (100 B/s) starts at
    its commit, 100/110 of the 1 s forward, and ends 100/110 s into the backward; its reload
    (1000 B/s) then ends 0.1 s later, while the kept group's backward took 30/110 s of the 3 s.
    With a link to host ten times faster the copy ends during the forward: no wait."""
    sizes, choice = {0: [100, 10]}, {chunk: {0} for chunk in PP1.chunks}
    policy = PlanPolicy(PP1, offload_groups=choice)
    starts, now = [], 0.0
    for action in PP1.actions:
        starts.append(now)
        now += 3.0 if action.kind is ActionKind.BACKWARD else 1.0
    slow = CopyTiming(bytes_per_s=100.0, reload_bytes_per_s=1000.0, action_starts_s=starts, iteration_s=now)
    expected = 100 / 110 + 100 / 100.0 - 1.0 + 100 / 1000.0 - 3.0 * 10 / 110
    assert policy.predicted_reload_waits(sizes, slow) == pytest.approx({chunk: expected for chunk in PP1.chunks}, rel=1e-12)
    fast = dataclasses.replace(slow, bytes_per_s=1000.0)
    assert policy.predicted_reload_waits(sizes, fast) == {chunk: 0.0 for chunk in PP1.chunks}
