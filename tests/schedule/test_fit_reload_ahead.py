"""`fit_reload_ahead`: a device budget's choice reloads ahead by a timing only where its peak still fits.

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
from chunk_offload.schedule import CopyTiming, PlanPolicy, choose_offload, fit_reload_ahead, megatron_plan, simulate
from chunk_offload.schedule import budget as budget_module

PLAN = megatron_plan(pp_size=2, pp_rank=0, num_microbatches=4)
SIZES = {0: [100, 10, 10]}


def _timing() -> CopyTiming:
    starts, now = [], 0.0
    for action in PLAN.actions:
        starts.append(now)
        now += 3.0 if action.kind is ActionKind.BACKWARD else 1.0
    return CopyTiming(bytes_per_s=1000.0, reload_bytes_per_s=40.0, action_starts_s=starts, iteration_s=now)


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
