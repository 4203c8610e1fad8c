"""The budget keywords of both integrations, `Budgets` in one process, and the host pool's cap setter.

The multi-rank behaviour (choices under real schedules, the exchanges, the node split) is tested
in ``megatron/test_budget.py`` and ``pipelining/test_budget.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch
from torch import nn

from chunk_offload import ChunkOffloadError, OffloadConfig, OffloadManager
from chunk_offload.core import Action, ActionKind, GroupStats, HostPool, IterationRecord
from chunk_offload.integrations.attached import ScheduleOptions
from chunk_offload.integrations.budgets import Budgets
from chunk_offload.integrations.exchange import Exchange
from chunk_offload.integrations.megatron import attach as megatron_attach
from chunk_offload.integrations.pipelining import attach as pipelining_attach
from chunk_offload.integrations.plan_tracking import PlanTracking
from chunk_offload.schedule import Plan, PlanPolicy, budget_exceeded_message, choose_offload, megatron_plan, simulate
from tests._driver import Hooks, assert_identical, drive
from chunk_offload.devkit.slow_link import LAYOUT, UNIT, chain, register, slow_streams

ATTACHES = {"megatron": lambda **kw: megatron_attach(nn.Linear(2, 2), "core_attn", **kw), "pipelining": lambda **kw: pipelining_attach(object(), ["x"], **kw)}


@pytest.mark.parametrize("which", sorted(ATTACHES))
@pytest.mark.parametrize("value", [-1, 1.5, True, "60GiB", "Auto"])
def test_bad_device_budget_is_refused(which: str, value: object) -> None:
    with pytest.raises(ChunkOffloadError, match=rf"^chunk_offload: device_budget_bytes must be an int number of bytes >= 0, 'auto' .*got {value!r}"):
        ATTACHES[which](device_budget_bytes=value)


@pytest.mark.parametrize("which", sorted(ATTACHES))
@pytest.mark.parametrize("value", [-1, 2.0, "auto", False])
def test_bad_host_budget_is_refused(which: str, value: object) -> None:
    with pytest.raises(ChunkOffloadError, match=rf"^chunk_offload: host_budget_bytes must be an int number of bytes >= 0 .*got {value!r}"):
        ATTACHES[which](host_budget_bytes=value)


@pytest.mark.parametrize("which", sorted(ATTACHES))
@pytest.mark.parametrize("value", [1 << 20, "auto"])
def test_device_budget_needs_the_plan(which: str, value: object) -> None:
    with pytest.raises(ChunkOffloadError, match=rf"device_budget_bytes={value!r} needs schedule_policy='plan'"):
        ATTACHES[which](device_budget_bytes=value, schedule_policy=None)


def _record(plan: Plan, group_bytes: list[int], *, offload: bool) -> IterationRecord:
    sim = simulate(plan, {vp: group_bytes for vp in range(plan.vp_size)})
    chunks = {tuple(c): list(group_bytes) for c in plan.chunks}
    return IterationRecord(
        offload=offload,
        peak_resident_bytes=sim.peak_saved_bytes,
        peak_saved_bytes=sim.peak_saved_bytes,
        host_bytes_at_saved_peak=0,
        device_peak_bytes=None,
        resident_trace=None,
        device_trace=None,
        group_bytes=chunks,
        groups={},
        order=list(plan.actions),
        wall_time_s=0.0,
        group_names={c: [f"g{i}" for i in range(len(group_bytes))] for c in chunks},
        action_starts_s=[0.0] * len(plan.actions),
    )


def test_budgets_choose_once_per_change_and_warn_once_when_infeasible() -> None:
    plan = megatron_plan(num_microbatches=4, pp_size=2, pp_rank=0)
    record = _record(plan, [1000, 3000, 2000], offload=False)
    lowest = choose_offload(plan, record.group_bytes, 0).lowest_peak_bytes
    baseline = record.peak_saved_bytes
    budgets = Budgets(device_budget_bytes=(lowest + baseline) // 2, host_budget_bytes=None, prefetch_bytes=None, reload_ahead_bytes=None)
    budgets.bind(pipeline_group=None, blocking=True)
    first = budgets.policy(plan)
    assert all(first.offload_chunk(_key(c)) for c in plan.chunks)  # before any record: every group offloaded
    policy = budgets.after_iteration(plan, record, first, pp_rank=0)
    choice = budgets.choice
    assert choice.fits and choice.predicted_peak_bytes <= (lowest + baseline) // 2 < baseline
    assert simulate(plan, record.group_bytes, policy=policy).peak_resident_bytes == choice.predicted_peak_bytes
    assert budgets.after_iteration(plan, record, policy, pp_rank=0) is None  # nothing changed: no new choice
    tight = Budgets(device_budget_bytes=lowest - 1, host_budget_bytes=None, prefetch_bytes=None, reload_ahead_bytes=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tight.after_iteration(plan, record, first, pp_rank=0)
        tight.after_iteration(plan, _record(plan, [1000, 3000, 2001], offload=False), first, pp_rank=0)
    shortfalls = [str(w.message) for w in caught if "device_budget_bytes" in str(w.message)]
    assert (lowest, baseline) == (7000, 12000)
    assert shortfalls == [
        "chunk_offload: pipeline rank 0: device_budget_bytes 6.8 KiB (6999 bytes) cannot be met: the lowest peak reachable "
        "is 6.8 KiB (7000 bytes) (every group offloaded; without offload 11.7 KiB (12000 bytes)), 1 bytes over; to reach "
        "it, offload more modules (--chunk-offload-modules), recompute activations (--recompute-granularity), use a "
        "smaller micro batch or fewer microbatches in flight, or raise the budget (to at least 7000 bytes, or 'auto')"
    ]
    assert tight.choice.predicted_peak_bytes == tight.choice.lowest_peak_bytes
    assert tight.summary(record)["budget_fits"] is False and tight.summary(record)["budget_shortfall_bytes"] == 3  # the latest choice: 7002 bytes (a group of 2001)


def test_budgets_warn_once_when_a_measured_peak_exceeds_a_budget_predicted_to_fit() -> None:
    """A choice predicted to fit, then an iteration under it peaking above the budget (on CUDA,
    memory the accounting does not see): one warning with the bytes over, and the report field."""
    plan = megatron_plan(num_microbatches=4, pp_size=2, pp_rank=0)
    record = _record(plan, [1000, 3000, 2000], offload=False)
    budget = record.peak_saved_bytes - 1
    budgets = Budgets(device_budget_bytes=budget, host_budget_bytes=None, prefetch_bytes=None, reload_ahead_bytes=None)
    budgets.bind(pipeline_group=None, blocking=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy = budgets.after_iteration(plan, record, budgets.policy(plan), pp_rank=1)
        assert budgets.choice.fits and budgets.summary(record)["budget_shortfall_bytes"] is None
        over = _record(plan, [1000, 3000, 2000], offload=True)  # measured: the baseline's peak, budget + 1
        for _ in range(2):
            budgets.after_iteration(plan, over, policy, pp_rank=1)
    messages = [str(w.message) for w in caught]
    assert messages == [budget_exceeded_message(rank=1, budget_bytes=budget, peak_bytes=budget + 1)]
    assert messages[0] == (
        f"chunk_offload: pipeline rank 1: device_budget_bytes {budget / 1024:.1f} KiB ({budget} bytes) was not met: the "
        f"iteration peaked at {(budget + 1) / 1024:.1f} KiB ({budget + 1} bytes), 1 bytes over; to reach it, offload more "
        "modules (--chunk-offload-modules), recompute activations (--recompute-granularity), use a smaller micro batch or "
        "fewer microbatches in flight, or raise the budget"
    )
    assert budgets.summary(over)["budget_shortfall_bytes"] == 1


def test_budgets_auto_and_host_split_in_one_process() -> None:
    plan = megatron_plan(num_microbatches=4, pp_size=2, pp_rank=0)
    record = _record(plan, [1000, 3000, 2000], offload=False)
    budgets = Budgets(device_budget_bytes="auto", host_budget_bytes=10 << 20, prefetch_bytes=None, reload_ahead_bytes=None)
    budgets.bind(pipeline_group=None, blocking=True)
    policy = budgets.after_iteration(plan, record, budgets.policy(plan), pp_rank=0)
    assert budgets.leveled_budget == budgets.choice.lowest_peak_bytes == budgets.choice.predicted_peak_bytes
    need = simulate(plan, record.group_bytes, policy=policy).host_bytes_at_saved_peak
    assert budgets.host_needs == [need] and budgets.host_cap == (10 << 20) // 512 * 512


def _key(chunk):
    from chunk_offload.core import ChunkKey

    return ChunkKey(*chunk)


def test_plan_tracking_takes_the_options() -> None:
    tracking = PlanTracking(ScheduleOptions(device_budget_bytes="auto", host_budget_bytes=0))
    assert tracking.budgets.active and tracking.budgets.device_budget == "auto" and tracking.budgets.host_budget == 0
    assert not PlanTracking(ScheduleOptions()).budgets.active


def test_exchange_without_distributed_is_this_rank_alone() -> None:
    blocking, deferred = Exchange(None, blocking=True), Exchange(None, blocking=False)
    assert blocking.post(7) == [7] and blocking.take() is None
    assert deferred.post(7) is None and deferred.post(8) == [7] and deferred.take() == [8]


def test_host_pool_set_capacity_releases_free_buffers_above_the_cap() -> None:
    pool = HostPool()
    held = [pool.acquire(4096) for _ in range(4)]
    for buf in held[:3]:
        pool.release(buf, None)
    assert pool.stats().allocated_bytes == 4 * 4096
    pool.set_capacity(2 * 4096)
    stats = pool.stats()
    assert pool.capacity_bytes == 2 * 4096 and stats.allocated_bytes == 2 * 4096 and stats.in_use_bytes == 4096
    with pytest.raises(ChunkOffloadError, match="capacity_bytes must be >= 0 or None, got -1"):
        pool.set_capacity(-1)
    pool.set_capacity(None)
    assert pool.capacity_bytes is None


def test_choices_use_the_largest_bytes_each_group_saved_so_far() -> None:
    """MoE expert groups change with the routing: the choice must hold for the largest bytes seen."""
    plan = megatron_plan(num_microbatches=4, pp_size=2, pp_rank=0)
    first, second = _record(plan, [1000, 3000, 2000], offload=False), _record(plan, [1500, 2000, 2000], offload=True)
    envelope = {c: [1500, 3000, 2000] for c in first.group_bytes}
    budget = (choose_offload(plan, envelope, 0).lowest_peak_bytes + first.peak_saved_bytes) // 2
    budgets = Budgets(device_budget_bytes=budget, host_budget_bytes=None, prefetch_bytes=None, reload_ahead_bytes=None)
    budgets.after_iteration(plan, first, budgets.policy(plan), pp_rank=0)
    with pytest.warns(RuntimeWarning, match=r"was not met: the iteration peaked at 10\.7 KiB \(11000 bytes\), 1500 bytes over"):
        # the synthetic record's peak is the one without offload, over the budget the first choice met
        policy = budgets.after_iteration(plan, second, budgets.policy(plan), pp_rank=0)
    assert budgets.choice == choose_offload(plan, envelope, budget)
    for record in (first, second):  # each iteration's own bytes peak at or under the envelope's prediction
        assert simulate(plan, record.group_bytes, policy=policy).peak_resident_bytes <= budgets.choice.predicted_peak_bytes <= budget
    fewer = _record(plan, [500, 500], offload=True)  # other group counts: start over from these bytes
    budgets.after_iteration(plan, fewer, policy, pp_rank=0)
    assert budgets.choice == choose_offload(plan, fewer.group_bytes, budget)


def _timed_record(plan: Plan, group_bytes: list[int], backward_s: float, peak_bytes: int) -> IterationRecord:
    """An offloaded iteration of ``plan`` peaking at ``peak_bytes``: forwards 1 s, backwards
    ``backward_s``, 1000 B/s out and 40 B/s back."""
    starts, now = [], 0.0
    for action in plan.actions:
        starts.append(now)
        now += backward_s if action.kind is ActionKind.BACKWARD else 1.0
    stats = GroupStats(bytes_offloaded=1000, offload_time_s=1.0, bytes_reloaded=40, reload_time_s=1.0)
    record = _record(plan, group_bytes, offload=True)
    return dataclasses.replace(record, groups={"g": stats}, action_starts_s=starts, wall_time_s=now, peak_resident_bytes=peak_bytes)


@pytest.mark.parametrize("timed", [True, False], ids=["timed", "one_ahead"])
def test_timed_reload_ahead_under_a_budget_keeps_the_choices_peak(timed: bool, caplog) -> None:
    """NOTE [Device budget]: with ``timed_reload_ahead`` the choice's chunks reload ahead by the
    latest timing where its predicted peak stays within the budget (`fit_reload_ahead`), and
    follow each new timing without a new choice; without it, one group ahead."""
    plan = megatron_plan(num_microbatches=4, pp_size=2, pp_rank=0)
    budgets = Budgets(device_budget_bytes=220, host_budget_bytes=None, prefetch_bytes=None, reload_ahead_bytes=None, timed_reload_ahead=timed)
    with caplog.at_level(logging.INFO, logger="chunk_offload.integrations.budgets"):
        policy = budgets.after_iteration(plan, _timed_record(plan, [100, 10, 10], 3.0, 220), budgets.policy(plan), pp_rank=0)
    reload_lines = [r.getMessage() for r in caplog.records if "timed reload ahead" in r.getMessage()]
    assert reload_lines == ([
        "chunk_offload: rank 0 (pipeline rank 0): timed reload ahead in 1 of the 4 chunks the device budget offloads (the "
        "others reload one group ahead: it waits least there, or reloading more ahead would raise their backward's peak "
        "above the budget)"
    ] if timed else [])  # fmt: skip
    choice = budgets.choice
    assert choice.predicted_peak_bytes == 220
    assert policy.timed_reload_ahead == budgets.chunk_reload_ahead == ({(1, 0): 110} if timed else {})
    assert simulate(plan, {0: [100, 10, 10]}, policy=policy).peak_resident_bytes == 220
    again = budgets.after_iteration(plan, _timed_record(plan, [100, 10, 10], 3.0, 220), policy, pp_rank=0)
    assert again is None  # the same timing: nothing changed
    slow_compute = budgets.after_iteration(plan, _timed_record(plan, [100, 10, 10], 30.0, 220), policy, pp_rank=0)
    assert budgets.choice is choice  # the same choice, reloads now hidden one group ahead
    if timed:
        assert slow_compute.timed_reload_ahead == {} and slow_compute.offload_groups == policy.offload_groups
    else:
        assert slow_compute is None
    given = Budgets(device_budget_bytes=220, host_budget_bytes=None, prefetch_bytes=None, reload_ahead_bytes=0, timed_reload_ahead=True)
    assert not given.timed_reload_ahead  # a given reload_ahead_bytes wins


def test_the_reload_ahead_budgets_are_fitted_again_only_when_the_timing_moves(monkeypatch) -> None:
    """NOTE [Timed reload ahead by default]: backwards 6% longer (a GPU's jitter) keep the budgets
    fitted to the timing before, without deriving them again; ten times longer derive them again."""
    from chunk_offload.integrations import budgets as budgets_module

    plan = megatron_plan(num_microbatches=4, pp_size=2, pp_rank=0)
    budgets = Budgets(device_budget_bytes=220, host_budget_bytes=None, prefetch_bytes=None, reload_ahead_bytes=None, timed_reload_ahead=True)
    policy = budgets.after_iteration(plan, _timed_record(plan, [100, 10, 10], 3.0, 220), budgets.policy(plan), pp_rank=0)
    fits = []
    fit = budgets_module.fit_reload_ahead
    monkeypatch.setattr(budgets_module, "fit_reload_ahead", lambda *args, **kwargs: fits.append(args[3]) or fit(*args, **kwargs))
    assert budgets.after_iteration(plan, _timed_record(plan, [100, 10, 10], 3.2, 220), policy, pp_rank=0) is None
    assert fits == [] and budgets.chunk_reload_ahead == {(1, 0): 110}
    moved = budgets.after_iteration(plan, _timed_record(plan, [100, 10, 10], 30.0, 220), policy, pp_rank=0)
    assert len(fits) == 1 and moved.timed_reload_ahead == {}  # reloads now hidden one group ahead


@pytest.mark.parametrize("pp_size", [2, 1], ids=["stage0_of_pp2", "pp1"])
def test_timed_reload_ahead_under_a_budget_waits_less_within_it(pp_size: int, caplog) -> None:
    """Stage 0 of PP=2, and PP=1, 4 microbatches, on a slow reload link (`tests._slow_link`),
    under a budget halfway between the lowest peak and the baseline's: a baseline, then `Budgets`
    decides after each iteration as the integrations do. With ``timed_reload_ahead`` the last
    iteration reloads ahead where the peak allows, on a choice made for a lower budget that
    leaves room for it (NOTE [Reload room]; the log says so once): it peaks where its policy
    predicts, within the budget, compute waits less than one group ahead, and losses and
    gradients are those of training without offload."""
    plan = megatron_plan(pp_size=pp_size, pp_rank=0, num_microbatches=4)
    run = dict(inputs=[torch.linspace(-1.0, 1.0, UNIT) + m for m in range(4)], order=plan.actions, iterations=3, lr=0.01)
    reference = drive(chain(), **run)
    sizes = {0: [4 * UNIT * k for k in LAYOUT]}
    everything = choose_offload(plan, sizes, 0)
    budget = (everything.lowest_peak_bytes + everything.baseline_peak_bytes) // 2
    runs = {}
    for timed in (False, True):
        model, manager = chain(), OffloadManager(OffloadConfig(min_offload_bytes=1), streams=slow_streams())
        register(manager, model)
        budgets = Budgets(device_budget_bytes=budget, host_budget_bytes=None, prefetch_bytes=None, reload_ahead_bytes=None, timed_reload_ahead=timed)
        manager.schedule_policy = budgets.policy(plan)
        records = []

        def after(manager, iteration, budgets=budgets, records=records):
            records.append(manager.last_iteration)
            policy = budgets.after_iteration(plan, records[-1], manager.schedule_policy, pp_rank=0)
            if policy is not None:
                manager.schedule_policy = policy

        caplog.clear()
        try:
            with caplog.at_level(logging.INFO, logger="chunk_offload.integrations.budgets"):
                result = drive(model, manager=manager, offload=lambda it: it > 0, hooks=Hooks(after_iteration=after), **run)
        finally:
            manager.close()
        assert_identical(reference, result)
        lower = [r.getMessage() for r in caplog.records if "to leave room for reloading ahead (NOTE [Reload room])" in r.getMessage()]
        assert len(lower) == timed  # logged once, when the first timing made the choice again
        runs[timed] = (budgets, records[-1])
    (one_ahead, plain), (timed, fitted) = runs[False], runs[True]
    assert one_ahead.chunk_reload_ahead == {} and timed.chunk_reload_ahead
    assert one_ahead.choice.fits and timed.choice.fits and timed.choice.budget_bytes == budget
    assert plain.peak_resident_bytes == one_ahead.choice.predicted_peak_bytes
    policy = PlanPolicy(plan, offload_groups=timed.choice, chunk_reload_ahead=timed.chunk_reload_ahead)
    assert fitted.peak_resident_bytes == simulate(plan, sizes, policy=policy).peak_resident_bytes <= budget
    waits = [sum(g.wait_time_s for g in record.groups.values()) for record in (plain, fitted)]
    assert waits[0] > 4 * waits[1], waits  # on an idle host: 200 ms (PP=2) and 320 ms (PP=1) against under 1 ms
