"""`PlanPolicy`: the offload and prefetch decisions read from a plan."""

from __future__ import annotations

import pytest

from chunk_offload import ChunkOffloadError
from chunk_offload.core import ChunkKey
from chunk_offload.schedule import Plan, PlanPolicy


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
    with pytest.raises(ChunkOffloadError, match="prefetch_bytes must be None or an int >= 0, got -1"):
        PlanPolicy(plan, prefetch_bytes=-1)
    with pytest.raises(ChunkOffloadError, match="reload_ahead_bytes must be None or an int >= 0, got 1.5"):
        PlanPolicy(plan, reload_ahead_bytes=1.5)
    assert policy.reload_ahead_bytes(ChunkKey(0, 0)) is None
    assert PlanPolicy(plan, reload_ahead_bytes=4096).reload_ahead_bytes(ChunkKey(1, 0)) == 4096
    with pytest.raises(ChunkOffloadError, match="PlanPolicy needs a chunk_offload.schedule.Plan, got list"):
        PlanPolicy(["0F0"])
