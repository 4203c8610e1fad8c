"""Reading torch schedules' own lists into plans, and `attach`'s checks, in one process (no ranks).

Schedules are built over mock `PipelineStage`s (as torch's own schedule visualizer does), so
their lists exist without a process group.
"""

from __future__ import annotations

import importlib.util
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining.stage import PipelineStage

from chunk_offload import ChunkOffloadError, OffloadConfig
from chunk_offload.integrations.pipelining import order
from chunk_offload.integrations.pipelining import PipelineOffloadManager, attach, listed_plan
from chunk_offload.schedule.megatron import megatron_plan
from chunk_offload.core import Action, ActionKind

from ...core._models import Block

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
PP = 2
MICROBATCHES = 4
SINGLE = ("Schedule1F1B", "ScheduleGPipe")
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
MULTI = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", *V_SHAPED)
_NO_MEGATRON = importlib.util.find_spec("megatron") is None


def _stage_indices(name: str, rank: int) -> list[int]:
    if name in SINGLE:
        return [rank]
    if name in V_SHAPED:
        return [rank, 2 * PP - 1 - rank]
    return [rank, rank + PP]


def _schedule(name: str, rank: int, submods: list[nn.Module] | None = None):
    if not hasattr(pipelining, name):
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.pipelining.{name}")
    indices = _stage_indices(name, rank)
    stages = []
    for i, index in enumerate(indices):
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.stage_index = rank, PP, index
        stage.num_stages = PP * (1 if name in SINGLE else 2)
        stage.submod = submods[i] if submods is not None else nn.Sequential(Block())
        stages.append(stage)
    cls = getattr(pipelining, name)
    return cls(stages[0] if name in SINGLE else stages, MICROBATCHES)


@pytest.mark.parametrize("rank", range(PP))
@pytest.mark.parametrize("name", [n for n in SINGLE + MULTI if n != "Schedule1F1B"])
def test_listed_plan_is_valid(name, rank):
    plan = listed_plan(_schedule(name, rank))
    vp_size = 1 if name in SINGLE else 2
    assert (plan.pp_rank, plan.pp_size, plan.vp_size, plan.source) == (rank, PP, vp_size, f"torch {name}")
    assert sorted(plan.chunks) == sorted((mb, vp) for mb in range(MICROBATCHES) for vp in range(vp_size))
    assert plan.has_weight_steps == (name in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"))


def test_schedule_1f1b_list_of_the_last_rank_is_invalid():
    megatron = megatron_plan(pp_size=PP, pp_rank=0, num_microbatches=MICROBATCHES)
    assert listed_plan(_schedule("Schedule1F1B", 0)).actions == megatron.actions
    last = _schedule("Schedule1F1B", PP - 1)
    assert [str(a) for a in order.listed_actions(last)] == ["0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0F4", "0B3"]
    with pytest.raises(ChunkOffloadError, match=r"step 0 \(0F1\): virtual stage 0 runs forwards in microbatch order: expected microbatch 0"):
        listed_plan(last)


@pytest.mark.skipif(_NO_MEGATRON, reason="megatron-core is not installed")
@pytest.mark.parametrize("rank", range(PP))
def test_interleaved_1f1b_lists_megatrons_interleaved_order(rank):
    """Two independent sources of one schedule agree: torch's list and Megatron's own tables."""
    torch_plan = listed_plan(_schedule("ScheduleInterleaved1F1B", rank))
    assert torch_plan.actions == megatron_plan(pp_size=PP, pp_rank=rank, num_microbatches=MICROBATCHES, vp_size=2).actions


def test_v_schedule_virtual_stages_are_local_stage_order():
    plan = listed_plan(_schedule("ScheduleZBVZeroBubble", 0))  # rank 0 holds stages 0 and 3
    assert plan.actions[:4] == (Action(F, 0, 0), Action(F, 1, 0), Action(F, 2, 0), Action(F, 0, 1))


def test_actions_map_to_plan_kinds():
    vp_of_stage = {0: 0, 3: 1}
    assert order.to_action("3F2", vp_of_stage) == [Action(F, 2, 1)]
    assert order.to_action("3B2", vp_of_stage) == [Action(B, 2, 1)]
    assert order.to_action("3I2", vp_of_stage) == [Action(B, 2, 1)]
    assert order.to_action("3W1", vp_of_stage) == [Action(W, 1, 1)]
    # The first stage: I computes nothing, W is the whole backward (NOTE [Zero-bubble weight steps]).
    assert order.to_action("0B1", vp_of_stage) == [Action(B, 1, 0)]
    assert order.to_action("0I1", vp_of_stage) == []
    assert order.to_action("0W1", vp_of_stage) == [Action(B, 1, 0)]
    assert order.to_action("(0F3;3B1)OVERLAP_F_B", vp_of_stage) == [Action(F, 3, 0), Action(B, 1, 1)]
    for bookkeeping in ("0SEND_F1", "3RECV_B0", "0UNSHARD", "3RESHARD", "0REDUCE_GRAD", ""):
        assert order.to_action(bookkeeping, vp_of_stage) == []
    with pytest.raises(ChunkOffloadError, match=r"lists 1F0 for stage 1, which is not on this rank \(its stages: \[0, 3\]\)"):
        order.to_action("1F0", vp_of_stage)


@pytest.mark.parametrize("name", ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"))
def test_first_stage_weight_steps_are_its_backward(name):
    """Rank 0 holds stage 0 (virtual stage 0): where torch lists its chunks' I the plan has
    nothing, where it lists their W the plan has their B; the other virtual stage keeps I as B
    and W as W."""
    schedule = _schedule(name, 0)
    vp_of_stage = {s.stage_index: vp for vp, s in enumerate(order.schedule_stages(schedule))}
    kinds = {"FORWARD": F, "FULL_BACKWARD": B, "BACKWARD_INPUT": B, "BACKWARD_WEIGHT": W}
    first = {"FORWARD": F, "FULL_BACKWARD": B, "BACKWARD_INPUT": None, "BACKWARD_WEIGHT": B}
    listed = [a for row in schedule.pipeline_order_with_comms[0] if row is not None for a in row.sub_actions or (row,)]
    assert any((a.stage_index, a.computation_type.name) == (0, "BACKWARD_INPUT") for a in listed)
    expected = []
    for a in listed:
        kind = (first if a.stage_index == 0 else kinds).get(a.computation_type.name)
        if kind is not None:
            expected.append(Action(kind, a.microbatch_index, vp_of_stage[a.stage_index]))
    plan = listed_plan(schedule)
    assert list(plan.actions) == expected
    assert not any(a.kind is W and a.vp_stage == 0 for a in plan.actions)
    assert any(a.kind is W and a.vp_stage == 1 for a in plan.actions)


@pytest.mark.parametrize(
    "method, args, kwargs, stage_index, expected",
    [
        ("backward_one_chunk", (), {}, 0, B),  # Schedule1F1B's call: full by default
        ("backward_one_chunk", (None,), {"full_backward": False}, 0, None),
        ("backward_one_chunk", (None, False), {}, 1, B),
        ("backward_weight_one_chunk", (), {"last_backward": True}, 0, B),
        ("backward_weight_one_chunk", (), {}, 3, W),
    ],
)
def test_backward_calls_map_to_plan_kinds(method, args, kwargs, stage_index, expected):
    stage = mock.Mock(stage_index=stage_index)
    assert order.backward_call_kind(stage, method, args, kwargs) is expected


def test_dual_pipe_v_overlap_actions_are_flattened_in_place():
    schedule = _schedule("ScheduleDualPipeV", 0)
    plan = listed_plan(schedule)
    # Rank 0 lists (0F3;3B1)OVERLAP_F_B right after 1F1: its two halves follow in that order.
    i = plan.index(F, 1, 1)
    assert plan.actions[i + 1 : i + 3] == (Action(F, 3, 0), Action(B, 1, 1))


# ---------------------------------------------------------------------------------- attach checks


def test_unmatched_pattern_lists_the_submodule_names():
    message = r"offload modules \['\*\.attention'\] match no submodule of this rank's stages \[0\]; .*'0\.core_attn'"
    with pytest.raises(ChunkOffloadError, match=message):
        attach(_schedule("Schedule1F1B", 0), ["*.core_attn", "*.attention"])


def test_nested_selection_is_refused():
    with pytest.raises(ChunkOffloadError, match=r"offload module 'block' selects '0' and 'attn' selects '0\.core_attn' inside it"):
        attach(_schedule("Schedule1F1B", 0), {"block": "0", "attn": "*.core_attn"})


def test_module_matched_twice_is_refused():
    with pytest.raises(ChunkOffloadError, match=r"'0\.attn_norm' of stage 0 is matched by offload modules 'norm' and 'first'"):
        attach(_schedule("Schedule1F1B", 0), {"norm": nn.LayerNorm, "first": "0.attn_norm"})


@pytest.mark.parametrize(
    "modules, message",
    [
        ([], r"offload_modules is empty"),
        ({"x": 3}, r"offload module 'x': each selector must be a non-empty name pattern or an nn.Module subclass, got \[3\]"),
        ({"x": [int]}, r"offload module 'x': each selector must be .* got \[<class 'int'>\]"),
        ({"": "*.core_attn"}, r"offload-module names must be non-empty strings, got ''"),
        (7, r"offload_modules must be a list of submodule name patterns or a mapping .* got int"),
        (None, r"offload_modules must be a list of submodule name patterns or a mapping .* got NoneType None"),
    ],
)
def test_bad_selectors(modules, message):
    with pytest.raises(ChunkOffloadError, match=message):
        attach(_schedule("Schedule1F1B", 0), modules)


def test_attach_needs_a_schedule():
    with pytest.raises(ChunkOffloadError, match=r"attach expects a torch.distributed.pipelining schedule .* got Sequential"):
        attach(nn.Sequential(), ["*"])


def test_selectors_by_pattern_and_class_and_detach_restores_everything():
    submods = [nn.Sequential(Block()), nn.Sequential(Block())]
    schedule = _schedule("ScheduleInterleaved1F1B", 0, submods)
    stages = order.schedule_stages(schedule)
    manager = attach(schedule, {"norm": nn.LayerNorm, "attn": ["*.core_attn", "*.qkv_linear"]}, config=OffloadConfig(min_offload_bytes=0))
    try:
        assert isinstance(manager, PipelineOffloadManager)
        assert manager.registered == {
            "norm": [["0.attn_norm", "0.mlp_norm"], ["0.attn_norm", "0.mlp_norm"]],
            "attn": [["0.qkv_linear", "0.core_attn"], ["0.qkv_linear", "0.core_attn"]],
        }
        assert "step" in vars(schedule) and all("forward_one_chunk" in vars(s) for s in stages)
        assert manager.plan is manager.listed_plan and manager.plan.vp_size == 2
        with pytest.raises(ChunkOffloadError, match=r"already has an offload manager attached; call its detach\(\) first"):
            attach(schedule, ["*.core_attn"])
        manager.detach()
        assert "step" not in vars(schedule)
        for stage in stages:
            for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                assert getattr(stage, method) is not None and not hasattr(getattr(stage, method), "__wrapped__")
        assert all(not m._forward_pre_hooks and not m._forward_hooks for s in submods for m in s.modules())
    finally:
        manager.close()


def test_layer_groups_register_each_module_with_its_layer_and_warn_where_none_is():
    """``group_by="layer"``: the layer of ``0.core_attn`` is the stage's Sequential element ``0`` (NOTE
    [Layer groups]); a stage whose selected modules lie in no such element says so."""
    config = OffloadConfig(min_offload_bytes=0, group_by="layer")
    submods = [nn.Sequential(Block())]
    manager = attach(_schedule("Schedule1F1B", 0, submods), ["*.core_attn", "*.qkv_linear"], config=config)
    try:
        assert [r.layer for r in manager.engine.module_offloads] == [submods[0][0]] * 2
    finally:
        manager.detach()
        manager.close()
    with pytest.warns(UserWarning, match=r"group_by='layer', but no offload module lies in a layer .*: each call is its own group"):
        manager = attach(_schedule("Schedule1F1B", 0, [Block()]), ["core_attn", "qkv_linear"], config=config)
    manager.detach()
    manager.close()
