"""The one adapter to torch.distributed.pipelining's private names: schedule lists -> `Plan`.

A torch schedule keeps its order per rank as ``_Action(stage_index, computation_type,
microbatch_index, sub_actions)`` lists: ``pipeline_order_with_comms`` (what
``_PipelineScheduleRuntime`` executes) or ``pipeline_order``. Here they become our `Plan`:

- ``FORWARD`` -> ``F``; ``FULL_BACKWARD`` and ``BACKWARD_INPUT`` -> ``B``; ``BACKWARD_WEIGHT`` -> ``W``;
- ``OVERLAP_F_B`` is replaced by its sub-actions, in the order the runtime runs them;
- communication, FSDP (un)shard and ``REDUCE_GRAD`` actions are dropped;
- the stage index becomes the virtual stage: the stage's position among this rank's stages in
  stage order (rank 0 of a V schedule with stages 0 and 3 has virtual stages 0 and 1).

Every other module of chunk_offload reaches torch's private schedule attributes (``_stage``,
``_stages``, ``_has_backward``, ``pipeline_order*``) only through the functions here, so a
torch release that renames them breaks one file.
"""

from __future__ import annotations

from typing import Any

from ...core import ChunkOffloadError
from ...core import Action, ActionKind
from ...schedule import Plan

try:
    from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineSchedule
except ImportError as e:  # torch built without distributed support
    raise ImportError(
        "chunk_offload: the torch.distributed.pipelining integration needs a torch build with "
        "torch.distributed (torch.distributed.is_available() is False here); install a standard "
        "torch wheel, e.g. pip install torch==2.13.0"
    ) from e

__all__ = [
    "is_schedule",
    "listed_actions",
    "listed_plan",
    "schedule_has_backward",
    "schedule_rank",
    "schedule_stages",
    "to_action",
]

_KINDS = {
    _ComputationType.FORWARD: ActionKind.FORWARD,
    _ComputationType.FULL_BACKWARD: ActionKind.BACKWARD,
    _ComputationType.BACKWARD_INPUT: ActionKind.BACKWARD,
    _ComputationType.BACKWARD_WEIGHT: ActionKind.WEIGHT,
}
_OVERLAP = _ComputationType.OVERLAP_F_B


def is_schedule(obj: Any) -> bool:
    """Whether ``obj`` is a torch.distributed.pipelining schedule."""
    return isinstance(obj, _PipelineSchedule)


def schedule_stages(schedule: Any) -> list[Any]:
    """This rank's pipeline stages of ``schedule``, in stage order."""
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        single = getattr(schedule, "_stage", None)
        stages = [] if single is None else [single]
    if not stages:
        raise ChunkOffloadError(
            f"{type(schedule).__name__} holds no pipeline stage (neither `_stage` nor `_stages`); "
            "attach expects a schedule built from PipelineStage objects"
        )
    return sorted(stages, key=lambda stage: stage.stage_index)


def schedule_rank(schedule: Any) -> int:
    """This rank's index in the pipeline group (the key of its row in the schedule's lists)."""
    return int(schedule_stages(schedule)[0].group_rank)


def schedule_has_backward(schedule: Any) -> bool:
    """Whether the next ``step`` runs backward (False for ``eval()`` and schedules without a loss)."""
    return bool(getattr(schedule, "_has_backward", True))


def to_action(action: Any, vp_of_stage: dict[int, int]) -> list[Action]:
    """Our actions for one torch ``_Action`` or its string (``"1F0"``, ``"(0F3;3B1)OVERLAP_F_B"``).

    Empty for communication and bookkeeping actions. ``vp_of_stage`` maps this rank's stage
    indices to virtual stages.
    """
    if isinstance(action, str):  # rows loaded from CSV, tests
        action = _Action.from_str(action)
    if action is None:
        return []
    if action.computation_type is _OVERLAP:
        return [a for sub in action.sub_actions or () for a in to_action(sub, vp_of_stage)]
    kind = _KINDS.get(action.computation_type)
    if kind is None:
        return []
    if action.stage_index not in vp_of_stage:
        raise ChunkOffloadError(
            f"the schedule lists {action} for stage {action.stage_index}, which is not on this rank "
            f"(its stages: {sorted(vp_of_stage)})"
        )
    return [Action(kind, int(action.microbatch_index), vp_of_stage[action.stage_index])]


def listed_actions(schedule: Any) -> list[Action] | None:
    """This rank's compute actions as the schedule lists them, or None if it lists none.

    Not validated: a schedule's list can be wrong (see `listed_plan`).
    """
    rows = getattr(schedule, "pipeline_order_with_comms", None) or getattr(schedule, "pipeline_order", None)
    if not rows:
        return None
    rank = schedule_rank(schedule)
    if rank not in rows:
        raise ChunkOffloadError(f"{type(schedule).__name__} lists no actions for rank {rank}; it lists ranks {sorted(rows)}")
    vp_of_stage = {stage.stage_index: vp for vp, stage in enumerate(schedule_stages(schedule))}
    return [a for action in rows[rank] for a in to_action(action, vp_of_stage)]


def listed_plan(schedule: Any) -> Plan | None:
    """The `Plan` of this rank from the schedule's own list; None if it lists none.

    Raises `ChunkOffloadError` when the list is not a valid plan (torch 2.13's `Schedule1F1B`
    lists forwards 1..m instead of 0..m-1 for its last rank, for instance).
    """
    actions = listed_actions(schedule)
    if actions is None:
        return None
    stages = schedule_stages(schedule)
    return Plan(
        tuple(actions),
        pp_rank=schedule_rank(schedule),
        pp_size=int(stages[0].group_size),
        vp_size=len(stages),
        source=f"torch {type(schedule).__name__}",
    )

