"""The one adapter to torch.distributed.pipelining's private names: schedule lists -> `Plan`.

A torch schedule keeps its order per rank as ``_Action(stage_index, computation_type,
microbatch_index, sub_actions)`` lists: ``pipeline_order_with_comms`` (what
``_PipelineScheduleRuntime`` executes) or ``pipeline_order``. Here they become our `Plan`:

- ``FORWARD`` -> ``F``; ``FULL_BACKWARD`` and ``BACKWARD_INPUT`` -> ``B``; ``BACKWARD_WEIGHT`` -> ``W``,
  except on the first stage, whose ``BACKWARD_INPUT`` is no action and whose ``BACKWARD_WEIGHT``
  is its ``B`` (`plan_kind`, NOTE [Zero-bubble weight steps]);
- ``OVERLAP_F_B`` is replaced by its sub-actions, in the order the runtime runs them;
- communication, FSDP (un)shard and ``REDUCE_GRAD`` actions are dropped;
- the stage index becomes the virtual stage: the stage's position among this rank's stages in
  stage order (rank 0 of a V schedule with stages 0 and 3 has virtual stages 0 and 1).

Every other module of chunk_offload reaches torch's private schedule attributes (``_stage``,
``_stages``, ``_has_backward``, ``pipeline_order*``) only through the functions here, so a
torch release that renames them breaks one file.

NOTE [Zero-bubble weight steps]
Zero-bubble schedules split a chunk's backward into ``I`` (``BACKWARD_INPUT``: input gradients,
run with ``retain_graph=True``) and ``W`` (``BACKWARD_WEIGHT``: weight gradients from the
intermediates ``I`` kept). The saved tensors a ``W`` step unpacks stay referenced by autograd
until it ran, and a group frees a storage only when autograd drops its last reference, so
nothing is released before ``W``: a group reloaded in ``I`` stays resident for ``W``. In the plan
``I`` is ``B`` and ``W`` is ``W``; `simulate` reloads at ``B`` and frees at ``W``.
The first stage (stage index 0) is the exception: its inputs need no gradient, so torch's
``backward_one_chunk(full_backward=False)`` computes nothing there and touches no saved tensor,
and ``backward_weight_one_chunk`` runs the chunk's whole backward (``retain_graph=False``),
reloading and freeing group by group like a full backward. So on the first stage ``I`` is no
action of the plan and ``W`` is the chunk's ``B``. Read as ``B`` then ``W``, `simulate` had the
whole chunk back on device from ``I`` to the end of ``W``, a peak the device never reached
(issue 23: ScheduleDualPipeV's last steps on rank 0 over-predicted; every zero-bubble schedule
once the first stage is the heaviest). `plan_kind` alone decides this: the listed plan
(`to_action`) and the observed order (`attach`'s wrappers, `backward_call_kind`) both ask it.
Not modelled: a stage built with ``dw_builder`` (its ``I`` runs the full backward, its ``W`` the
user's function).
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
    "backward_call_kind",
    "is_schedule",
    "listed_actions",
    "listed_plan",
    "plan_kind",
    "schedule_has_backward",
    "schedule_rank",
    "schedule_stages",
    "to_action",
]

_FULL, _INPUT, _WEIGHT = _ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT
_KINDS = {
    _ComputationType.FORWARD: ActionKind.FORWARD,
    _FULL: ActionKind.BACKWARD,
    _INPUT: ActionKind.BACKWARD,
    _WEIGHT: ActionKind.WEIGHT,
}
_OVERLAP = _ComputationType.OVERLAP_F_B


def plan_kind(stage_index: int, computation: Any) -> ActionKind | None:
    """The plan's kind of torch's compute ``computation`` (a `_ComputationType`) on stage ``stage_index``.

    ``F`` for a forward, ``B`` for a full backward; for a split one ``B`` (``I``) and ``W`` (``W``),
    except on the first stage: no action (None, ``I``) and ``B`` (``W``), as NOTE [Zero-bubble
    weight steps] explains.
    """
    if stage_index == 0 and computation in (_INPUT, _WEIGHT):  # See NOTE [Zero-bubble weight steps]
        return None if computation is _INPUT else ActionKind.BACKWARD
    return _KINDS[computation]


def backward_call_kind(stage: Any, method: str, args: tuple, kwargs: dict) -> ActionKind | None:
    """`plan_kind` of one call ``stage.<method>(bwd_chunk_id, *args, **kwargs)``, ``method`` being
    ``backward_one_chunk`` (its ``full_backward`` says full or ``I``) or ``backward_weight_one_chunk``."""
    if method == "backward_weight_one_chunk":
        return plan_kind(stage.stage_index, _WEIGHT)
    # backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, last_backward=False)
    full = kwargs["full_backward"] if "full_backward" in kwargs else (args[1] if len(args) > 1 else True)
    return plan_kind(stage.stage_index, _FULL if full else _INPUT)


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

    Empty for communication and bookkeeping actions and for the first stage's ``I`` (`plan_kind`).
    ``vp_of_stage`` maps this rank's stage indices to virtual stages.
    """
    if isinstance(action, str):  # rows loaded from CSV, tests
        action = _Action.from_str(action)
    if action is None:
        return []
    if action.computation_type is _OVERLAP:
        return [a for sub in action.sub_actions or () for a in to_action(sub, vp_of_stage)]
    if action.computation_type not in _KINDS:
        return []
    if action.stage_index not in vp_of_stage:
        raise ChunkOffloadError(
            f"the schedule lists {action} for stage {action.stage_index}, which is not on this rank "
            f"(its stages: {sorted(vp_of_stage)})"
        )
    kind = plan_kind(action.stage_index, action.computation_type)
    return [] if kind is None else [Action(kind, int(action.microbatch_index), vp_of_stage[action.stage_index])]


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

