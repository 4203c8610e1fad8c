"""`PlanPolicy`: the offload and prefetch decisions read from a plan."""

from __future__ import annotations

import pytest

from chunk_offload import ChunkOffloadError
from chunk_offload.core import ChunkKey
from chunk_offload.schedule import CopyTiming, Plan, PlanPolicy, megatron_plan, simulate


def test_plan_policy_decisions():
    plan = Plan.from_order(["0F0", "0F1", "0B0", "0F2", "0B2", "0B1"], source="t")
    policy = PlanPolicy(plan)
    assert policy.kept_chunks() == [(2, 0)]  # its backward follows at once
    assert policy.offload_chunk(ChunkKey(0, 0)) and not policy.offload_chunk(ChunkKey(2, 0))
    assert policy.offload_chunk(ChunkKey(9, 0))  # a chunk the plan does not know: as without a plan
    # F1 comes before B0: the reload of chunk 0 starts when F1 starts; B2 comes before B1.
    assert list(policy.prefetch_on("F", ChunkKey(1, 0))) == [(ChunkKey(0, 0), None)]
    assert list(policy.prefetch_on("B", ChunkKey(2, 0))) == [(ChunkKey(1, 0), None)]
    assert list(policy.prefetch_on("F", ChunkKey(2, 0))) == []  # B2 is kept on device: nothing to reload
    assert list(PlanPolicy(plan, prefetch_bytes=0).prefetch_on("F", ChunkKey(1, 0))) == []
    assert list(PlanPolicy(plan, prefetch_bytes=64).prefetch_on("F", ChunkKey(1, 0))) == [(ChunkKey(0, 0), 64)]
    with pytest.raises(ChunkOffloadError, match="prefetch_bytes must be an int number of bytes >= 0 or None, got -1"):
        PlanPolicy(plan, prefetch_bytes=-1)
    with pytest.raises(ChunkOffloadError, match="reload_ahead_bytes must be an int number of bytes >= 0 or None, got 1.5"):
        PlanPolicy(plan, reload_ahead_bytes=1.5)
    assert policy.reload_ahead_bytes(ChunkKey(0, 0)) is None
    assert PlanPolicy(plan, reload_ahead_bytes=4096).reload_ahead_bytes(ChunkKey(1, 0)) == 4096
    with pytest.raises(ChunkOffloadError, match="PlanPolicy needs a chunk_offload.schedule.Plan, got list"):
        PlanPolicy(["0F0"])


def test_chunks_whose_backward_follows_copy_all_but_their_last_group():
    """NOTE [Kept tail]: at PP=1 each F is followed by its B; with the groups known the first
    ones are copied, without them the chunk stays whole; a timing keeps more of the tail."""
    plan = megatron_plan(pp_size=1, pp_rank=0, num_microbatches=2)
    assert [str(a) for a in plan.actions] == ["0F0", "0B0", "0F1", "0B1"]
    assert PlanPolicy(plan).kept_chunks() == plan.chunks
    policy = PlanPolicy(plan, group_bytes={0: [100, 100, 100, 100]})
    assert policy.copied_head == {(0, 0): 3, (1, 0): 3} and policy.kept_chunks() == []
    assert [policy.offload_group(ChunkKey(1, 0), g) for g in range(4)] == [True, True, True, False]
    assert simulate(plan, {0: [100] * 4}, policy=PlanPolicy(plan)).peak_resident_bytes == 400
    predicted = simulate(plan, {0: [100] * 4}, policy=policy)
    assert (predicted.peak_resident_bytes, predicted.bytes_offloaded) == (200, 600)
    # Actions start at 0, 1, 2, 3 s of a 4 s iteration: 2 s of forward and backward per chunk,
    # 0.5 s per group; at 1000 bytes/s a copy out and back of 100 bytes takes 0.2 s.
    timing = CopyTiming(bytes_per_s=1000.0, action_starts_s=[0.0, 1.0, 2.0, 3.0], iteration_s=4.0)
    assert PlanPolicy(plan, group_bytes={0: [100] * 4}, timing=timing).copied_head == {(0, 0): 3, (1, 0): 3}
    slow = CopyTiming(bytes_per_s=250.0, action_starts_s=[0.0, 1.0, 2.0, 3.0], iteration_s=4.0)  # 0.8 s: hides behind 2 groups
    assert PlanPolicy(plan, group_bytes={0: [100] * 4}, timing=slow).copied_head == {(0, 0): 2, (1, 0): 2}
    # The same offload rate with reloads at 125 bytes/s: 0.1 + 0.8 s out and back, hidden behind 2 groups only.
    slow_back = CopyTiming(bytes_per_s=1000.0, reload_bytes_per_s=125.0, action_starts_s=[0.0, 1.0, 2.0, 3.0], iteration_s=4.0)
    assert slow_back.round_trip_s(100) == 0.1 + 0.8
    assert PlanPolicy(plan, group_bytes={0: [100] * 4}, timing=slow_back).copied_head == {(0, 0): 2, (1, 0): 2}
