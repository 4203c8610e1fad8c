"""`PlanPolicy`'s reload-ahead budgets from a measured timing (NOTE [Timed reload ahead]).

The policy's per-chunk values on a hand-built timing, `simulate` against the engine with them, and
a measurement on CPU streams whose reload link and backward compute take real (slept) time.
"""

from __future__ import annotations

import pytest
import torch

from chunk_offload import OffloadConfig, OffloadManager
from chunk_offload.core import ChunkKey
from chunk_offload.schedule import CopyTiming, PlanPolicy, megatron_plan, simulate
from tests._driver import Hooks, assert_identical, drive
from chunk_offload.devkit.slow_link import LAYOUT, UNIT, chain, register, slow_streams
from tests.schedule._train import train_plan


def _pp1_timing(backward_s: tuple[float, float]) -> CopyTiming:
    """Actions 0F0 0B0 0F1 0B1, each forward 1 s, the backwards as given; 1000 B/s out, 60 B/s back."""
    starts = (0.0, 1.0, 1.0 + backward_s[0], 2.0 + backward_s[0])
    return CopyTiming(bytes_per_s=1000.0, reload_bytes_per_s=60.0, action_starts_s=starts, iteration_s=starts[-1] + backward_s[1])


def test_plan_policy_sets_each_chunks_budget_from_the_timing():
    """Forward order: a large group (100 B), a small one (10 B), the kept last one (10 B). A backward
    of 12 s spreads 10 s, 1 s, 1 s over them; the large reload (1.67 s at 60 B/s) cannot hide behind
    the small group's 1 s, but started with the small one during the kept group's it ends at 1.83 s:
    110 bytes ahead. A backward of 120 s hides it one group ahead."""
    plan = megatron_plan(pp_size=1, pp_rank=0, num_microbatches=2)
    sizes = {0: [100, 10, 10]}
    timing = _pp1_timing((12.0, 120.0))
    policy = PlanPolicy(plan, group_bytes=sizes, reload_timing=timing)
    assert policy.copied_head == {(0, 0): 2, (1, 0): 2} == PlanPolicy(plan, group_bytes=sizes).copied_head
    assert policy.timed_reload_ahead == {(0, 0): 110}
    assert [policy.reload_ahead_bytes(ChunkKey(m, 0)) for m in (0, 1)] == [110, None]
    assert "timed reload ahead in 1 of 2 chunks" in repr(policy)
    assert PlanPolicy(plan, group_bytes=sizes, timing=timing).timed_reload_ahead == {(0, 0): 110}
    # A value given wins (0: one group ahead); per-group decisions and unknown groups keep it too.
    for given in (0, 4096):
        chosen = PlanPolicy(plan, group_bytes=sizes, reload_ahead_bytes=given, reload_timing=timing)
        assert chosen.timed_reload_ahead == {} and chosen.reload_ahead_bytes(ChunkKey(0, 0)) == given
    assert PlanPolicy(plan, offload_groups={(0, 0): {0, 1}}, group_bytes=sizes, reload_timing=timing).timed_reload_ahead == {}
    assert PlanPolicy(plan, reload_timing=timing).timed_reload_ahead == {}
    # The price in memory, as simulate predicts it: chunk 0's backward starts with all three groups
    # on device (120 bytes) where one group ahead peaks at 110.
    assert simulate(plan, sizes, policy=policy).peak_resident_bytes == 120
    assert simulate(plan, sizes, policy=PlanPolicy(plan, group_bytes=sizes)).peak_resident_bytes == 110


@pytest.mark.parametrize(
    "plan_kwargs", [dict(pp_size=4, pp_rank=3, num_microbatches=4), dict(pp_size=4, pp_rank=1, num_microbatches=6)], ids=["1f1b_last", "1f1b_middle"]
)
def test_simulate_predicts_the_engine_with_per_chunk_budgets(plan_kwargs):
    """The test stack's groups, a timing whose backward of microbatch m takes 1 + m s on a 10 kB/s
    link: each chunk gets its own budget (the middle stage's chunks after a prefetch of their last
    group), and the engine's peaks are simulate's to the byte, numerics unchanged."""
    plan = megatron_plan(**plan_kwargs)
    reference, _ = train_plan(plan, offload=None)
    _, baseline = train_plan(plan, offload=False, iterations=1, group_by="module")  # a group per module call
    sizes = baseline[0].group_bytes
    starts, now = [], 0.0
    for action in plan.actions:
        starts.append(now)
        now += 1.0 + (action.microbatch if action.kind.value == "B" else 0.0)
    timing = CopyTiming(bytes_per_s=1e4, action_starts_s=starts, iteration_s=now)
    policy = PlanPolicy(plan, group_bytes=sizes, reload_timing=timing)
    assert list(policy.timed_reload_ahead.values())[:4] == [4224, 6272, 12480, 14528]
    result, records = train_plan(plan, policy, group_by="module")
    assert_identical(reference, result)
    one_ahead = simulate(plan, sizes, policy=PlanPolicy(plan, group_bytes=sizes))
    for measured in records:
        predicted = simulate(plan, sizes, policy=policy, kept_bytes=measured.kept_bytes_of)
        assert predicted.peak_resident_bytes == measured.peak_resident_bytes > one_ahead.peak_resident_bytes
        assert predicted.bytes_offloaded == sum(g.bytes_offloaded for g in measured.groups.values())


def test_timed_budget_waits_less_than_one_group_ahead_on_a_slow_link():
    """PP=1, two microbatches. One group ahead, each large reload (50 ms) starts when the small
    group after it starts its 10 ms backward: about 40 ms of wait per large group but the kept
    one. The budget from that iteration's timing reloads each large group with the small one
    during the large backward before them: no wait predicted. Losses and gradients are those of
    training without offload."""
    plan = megatron_plan(pp_size=1, pp_rank=0, num_microbatches=2)
    inputs = [torch.linspace(-1.0, 1.0, UNIT) + m for m in range(2)]
    run = dict(inputs=inputs, order=plan.actions, iterations=3, lr=0.01)
    reference = drive(chain(), **run)

    model = chain()
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1), streams=slow_streams())
    register(manager, model)
    records, policies = [], []

    def after(manager, iteration):
        record = manager.last_iteration
        records.append(record)
        if iteration == 0:  # the baseline: learn the groups, reload one group ahead
            policies.append(PlanPolicy(plan, group_bytes=record.group_bytes))
        else:  # from the latest offloaded iteration's timing, as the integrations do
            policies.append(PlanPolicy(plan, group_bytes=records[0].group_bytes, reload_timing=CopyTiming.from_record(record, plan)))
        manager.schedule_policy = policies[-1]

    try:
        result = drive(model, manager=manager, offload=lambda it: it > 0, hooks=Hooks(after_iteration=after), **run)
    finally:
        manager.close()
    assert_identical(reference, result)
    assert policies[0].copied_head == {(0, 0): 7, (1, 0): 7} and policies[0].timed_reload_ahead == {}
    assert policies[1].timed_reload_ahead == {(0, 0): 11 * 4 * UNIT, (1, 0): 11 * 4 * UNIT}
    one_ahead, timed = (sum(g.wait_time_s for g in records[i].groups.values()) for i in (1, 2))
    assert [sum(g.bytes_offloaded for g in records[i].groups.values()) for i in (1, 2)] == [2 * 4 * UNIT * sum(LAYOUT[:-1])] * 2
    assert one_ahead > 3 * timed, (one_ahead, timed)


def test_close_timings_are_within_the_tolerance_of_each_rate_and_action():
    """`CopyTiming.close_to`: each rate within 10% of the larger, each action's duration within 10%
    of the larger or of the mean action (so a short action's jitter is no change)."""
    base = _pp1_timing((12.0, 12.0))  # actions of 1, 12, 1 and 12 s: a mean of 6.5 s
    assert base.close_to(base) and not base.close_to(None)
    assert base.close_to(CopyTiming(bytes_per_s=1090.0, reload_bytes_per_s=60.0, action_starts_s=base.action_starts_s, iteration_s=base.iteration_s))
    assert not base.close_to(CopyTiming(bytes_per_s=1120.0, reload_bytes_per_s=60.0, action_starts_s=base.action_starts_s, iteration_s=base.iteration_s))
    assert not base.close_to(CopyTiming(bytes_per_s=1000.0, reload_bytes_per_s=67.0, action_starts_s=base.action_starts_s, iteration_s=base.iteration_s))
    assert not base.close_to(CopyTiming(bytes_per_s=1000.0, action_starts_s=base.action_starts_s, iteration_s=base.iteration_s))
    assert base.close_to(_pp1_timing((13.0, 12.0)))  # a backward 1 s longer: under 10% of 13 s
    assert not base.close_to(_pp1_timing((14.0, 12.0)))  # 2 s: over 10% of 14 s
    # A forward of 1.5 s instead of 1 s: 50% of itself, under 10% of the mean action.
    shifted = (0.0, 1.5, 13.5, 14.5)
    assert base.close_to(CopyTiming(bytes_per_s=1000.0, reload_bytes_per_s=60.0, action_starts_s=shifted, iteration_s=26.5))
    assert not base.close_to(CopyTiming(bytes_per_s=1000.0, reload_bytes_per_s=60.0, action_starts_s=(0.0, 1.0, 13.0), iteration_s=25.0))
    assert base.close_to(CopyTiming(bytes_per_s=1000.0, reload_bytes_per_s=60.0, action_starts_s=base.action_starts_s,
                                    iteration_s=base.iteration_s), tolerance=0.0)  # fmt: skip
