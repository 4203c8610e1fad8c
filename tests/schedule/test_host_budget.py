"""`split_host_budget` (pure) and the node collective `node_host_cap` (2 and 4 gloo ranks)."""

from __future__ import annotations

import random

import pytest
import torch.distributed as dist

from chunk_offload import ChunkOffloadError
from chunk_offload.schedule import all_gather_host_needs, node_host_cap, split_host_budget
from tests._spawn import run_ranks

MiB = 1 << 20


def test_shares_follow_the_needs_and_early_stages_get_more():
    # PP=4 1F1B: stage s holds 4 - s microbatches in flight, so its need falls with s.
    needs = [4 * 100 * MiB, 3 * 100 * MiB, 2 * 100 * MiB, 1 * 100 * MiB]
    caps = split_host_budget(2000 * MiB, needs)
    assert caps == [800 * MiB, 600 * MiB, 400 * MiB, 200 * MiB]


def test_a_budget_below_the_need_cuts_every_rank_by_the_same_fraction():
    caps = split_host_budget(500 * MiB, [600 * MiB, 300 * MiB, 100 * MiB])
    assert caps == [300 * MiB, 150 * MiB, 50 * MiB]


def test_rounding_to_units_never_exceeds_the_budget_and_gives_leftovers_by_largest_remainder():
    # 10 units over needs 1:1:1 -> 3 each and one left, which goes to the lowest rank (equal remainders).
    assert split_host_budget(10 * 512 + 100, [7, 7, 7]) == [4 * 512, 3 * 512, 3 * 512]
    # 10 units over needs 1:2:4: exact shares 10/7, 20/7, 40/7 -> 1, 2, 5 and 2 left, to the
    # largest remainders 6/7 (rank 1) and 5/7 (rank 2); rank 0's is 3/7.
    assert split_host_budget(10 * 512, [1, 2, 4]) == [1 * 512, 3 * 512, 6 * 512]


def test_random_splits_sum_to_the_budget_in_units_and_stay_proportional():
    rng = random.Random(0)
    for _ in range(500):
        ranks = rng.randint(1, 8)
        needs = [rng.choice([0, rng.randint(1, 1 << 34)]) for _ in range(ranks)]
        budget = rng.randint(0, 1 << 36)
        unit = rng.choice([1, 512, 4096])
        caps = split_host_budget(budget, needs, unit=unit)
        assert len(caps) == ranks and all(c % unit == 0 and c >= 0 for c in caps)
        total = sum(needs)
        if total == 0:
            assert caps == [0] * ranks
            continue
        assert sum(caps) == budget // unit * unit
        for cap, need in zip(caps, needs):
            exact = budget // unit * need / total
            assert exact - 1 < cap / unit < exact + 1, (cap, need, needs, budget)
            if need == 0:
                assert cap == 0


def test_ranks_that_need_nothing_get_nothing():
    assert split_host_budget(1 << 30, [0, 1 << 20, 0, 3 << 20]) == [0, 256 * MiB, 0, 768 * MiB]
    assert split_host_budget(1 << 30, [0, 0]) == [0, 0]
    assert split_host_budget(0, [5 << 20, 1 << 20]) == [0, 0]


@pytest.mark.parametrize(
    "call, expected",
    [
        (lambda: split_host_budget("1GiB", [1]), "node_budget_bytes must be an int number of bytes >= 0, got '1GiB'"),
        (lambda: split_host_budget(-1, [1]), "node_budget_bytes must be an int number of bytes >= 0, got -1"),
        (lambda: split_host_budget(2.5, [1]), "node_budget_bytes must be an int number of bytes >= 0, got 2.5"),
        (lambda: split_host_budget(True, [1]), "node_budget_bytes must be an int number of bytes >= 0, got True"),
        (lambda: split_host_budget(1, []), "needs must be a non-empty sequence of byte counts, one per rank of the node, got []"),
        (lambda: split_host_budget(1, 5), "needs must be a non-empty sequence of byte counts, one per rank of the node, got 5"),
        (lambda: split_host_budget(1, [1, float("nan")]), "needs[1] must be an int number of bytes >= 0, got nan"),
        (lambda: split_host_budget(1, [1], unit=0), "unit must be an int >= 1, got 0"),
    ],
)
def test_bad_input_names_the_parameter_and_value(call, expected):
    with pytest.raises(ChunkOffloadError) as info:
        call()
    assert str(info.value).startswith("chunk_offload: " + expected)


def test_the_collective_needs_an_initialized_process_group():
    if dist.is_initialized():  # pragma: no cover - the test process never initializes one
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(ChunkOffloadError, match="all_gather_host_needs needs torch.distributed initialized"):
        all_gather_host_needs(1)


# ------------------------------------------------------------------------------- gloo ranks

BUDGET = 1000 * MiB


def _rank_caps(rank: int, world_size: int, per_node: int) -> dict:
    need = (world_size - rank) * 10 * MiB if rank % 3 else 0  # rank 0, 3: nothing on host
    group, _ = dist.new_subgroups(group_size=per_node)  # COLLECTIVE: one group per node
    cap, needs, caps = node_host_cap(BUDGET, need, group=group)
    return dict(cap=cap, needs=needs, caps=caps, need=need)


@pytest.mark.parametrize("world_size, per_node", [(2, 2), (4, 2), (4, 4)])
def test_node_host_cap_over_gloo_ranks(world_size: int, per_node: int):
    results = run_ranks(_rank_caps, (per_node,), world_size=world_size, timeout_s=60.0, what="host budget ranks")
    for node in range(world_size // per_node):
        ranks = range(node * per_node, (node + 1) * per_node)
        needs = [results[r]["need"] for r in ranks]
        expected = split_host_budget(BUDGET, needs)
        for local, r in enumerate(ranks):
            assert results[r]["needs"] == needs, "every rank sees the node's needs in local rank order"
            assert results[r]["caps"] == expected
            assert results[r]["cap"] == expected[local]
        assert sum(expected) <= BUDGET
