"""`Plan` as data, and `megatron_plan` against megatron-core's own conversion of its table."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

from chunk_offload import ChunkOffloadError
from chunk_offload.core import Action, ActionKind
from chunk_offload.schedule import Plan, megatron_plan

_NO_MEGATRON = importlib.util.find_spec("megatron") is None


def test_action_strings_round_trip():
    for text in ("0F0", "1B12", "3W7"):
        assert str(Action.parse(text)) == text
    assert Action.parse("1F0") == Action(ActionKind.FORWARD, 0, 1)
    with pytest.raises(ChunkOffloadError, match=r"cannot parse action 'F'; expected <vp_stage><F\|B\|W><microbatch>"):
        Action.parse("F")


@pytest.mark.parametrize(
    "order, message",
    [
        (["0F0", "0B1", "0F1", "0B0"], r"step 1 \(0B1\): 0B1 runs before its forward"),
        (["0F1", "0F0", "0B0", "0B1"], r"step 0 \(0F1\): virtual stage 0 runs forwards in microbatch order: expected microbatch 0"),
        (["0F0", "0F0", "0B0"], r"step 1 \(0F0\): 0F0 appears twice"),
        (["0F0", "0F1", "0B0"], r"forwards without a backward: \['0B1'\]"),
        (["0F0", "0W0", "0B0"], r"step 1 \(0W0\): 0W0 runs before its backward"),
        (["1F0", "1B0"], r"vp_stage in \[0, 1\)"),
    ],
)
def test_invalid_plans_name_the_step(order, message):
    with pytest.raises(ChunkOffloadError, match=message):
        Plan.from_order(order, source="test")


def test_queries():
    plan = Plan.from_order(["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"])
    assert plan.chunks == [(0, 0), (1, 0), (2, 0)]
    assert [plan.lifespan(m, 0) for m in range(3)] == [1, 2, 1]
    assert plan.in_flight() == [1, 2, 1, 2, 1, 0]
    zero_bubble = Plan.from_order(["0F0", "0F1", "0B0", "0B1", "0W0", "0W1"])
    assert zero_bubble.in_flight() == [1, 2, 2, 2, 1, 0]  # tensors live until the weight step
    assert plan.diff(["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]) is None
    difference = plan.diff([("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("B", 0, 0), ("B", 1, 0), ("B", 2, 0)])
    assert difference.startswith("step 2: plan says 0B0, observed 0F2")
    assert "[0B0]" in difference and "[0F2]" in difference
    assert plan.diff(["0F0"]).startswith("plan has 6 actions, observed 1")


def test_megatron_plan_argument_errors():
    with pytest.raises(ChunkOffloadError, match="pp_rank 4 is out of range for pp_size 4"):
        megatron_plan(pp_size=4, pp_rank=4, num_microbatches=8)
    with pytest.raises(ChunkOffloadError, match="num_microbatches as an int >= 1, got 0"):
        megatron_plan(pp_size=4, pp_rank=0, num_microbatches=0)


def test_one_f_one_b_layout():
    plan = megatron_plan(pp_size=4, pp_rank=1, num_microbatches=5)
    assert plan.format() == "0F0 0F1 0F2 0B0 0F3 0B1 0F4 0B2 0B3 0B4"
    assert max(plan.in_flight()) == 3  # stage s of p holds p - s chunks
    last = megatron_plan(pp_size=4, pp_rank=3, num_microbatches=3)
    assert last.format() == "0F0 0B0 0F1 0B1 0F2 0B2"


@pytest.mark.skipif(_NO_MEGATRON, reason="needs megatron-core")
@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("vp", [2, 3])
@pytest.mark.parametrize("microbatches_per_pp", [1, 2, 3])
@pytest.mark.parametrize("group_extra", [0, 1, 2])
def test_interleaved_plan_matches_megatrons_own_order(pp, vp, microbatches_per_pp, group_extra):
    """Chunk sequence equals megatron's ``convert_schedule_table_to_order`` on every rank."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.pipeline_parallel.schedules import get_schedule_table
        from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order

    m, group = pp * microbatches_per_pp, pp + group_extra
    table = get_schedule_table(m, vp, group)
    for rank in range(pp):
        plan = megatron_plan(pp_size=pp, pp_rank=rank, num_microbatches=m, vp_size=vp, microbatch_group_size_per_vp_stage=group)
        warmup = next(i for i, a in enumerate(plan.actions) if a.kind is ActionKind.BACKWARD)
        warmup -= 0 if warmup == len(plan.chunks) else 1  # the first backward follows one steady-state forward
        encoded = [a.vp_stage + 1 if a.kind is ActionKind.FORWARD else -a.vp_stage - 1 for a in plan.actions]
        assert encoded == convert_schedule_table_to_order(warmup, vp, table), (pp, vp, m, group, rank)
        assert len(plan.actions) == 2 * m * vp and max(plan.in_flight()) <= m * vp
