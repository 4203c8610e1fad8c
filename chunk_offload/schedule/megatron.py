"""Plans of Megatron's 1F1B and interleaved 1F1B schedules, from Megatron's own tables.

`megatron_plan` asks megatron-core for the warm-up length (``get_pp_rank_microbatches``) and
the virtual-microbatch table (``get_schedule_table``) and lays them out the way
``forward_backward_pipelining_with_interleaving`` / ``_without_interleaving`` run them: warm-up
forwards, then one forward and one backward per step, then the cool-down backwards. Megatron
is imported only when a plan is built.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

from ..core.errors import ChunkOffloadError
from ..core.actions import Action, ActionKind
from .plan import Plan

__all__ = ["megatron_plan"]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


def megatron_plan(
    *,
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    vp_size: int | None = None,
    microbatch_group_size_per_vp_stage: int | None = None,
) -> Plan:
    """The actions megatron-core's training schedule runs on pipeline rank ``pp_rank``.

    ``vp_size`` None or 1: ``forward_backward_pipelining_without_interleaving`` (or
    ``forward_backward_no_pipelining`` when ``pp_size`` is 1). Otherwise the interleaved
    schedule; ``microbatch_group_size_per_vp_stage`` defaults to ``pp_size`` like Megatron's.
    """
    for label, value, low in (("pp_size", pp_size, 1), ("num_microbatches", num_microbatches, 1), ("pp_rank", pp_rank, 0)):
        if not isinstance(value, int) or value < low:
            raise ChunkOffloadError(f"megatron_plan needs {label} as an int >= {low}, got {value!r}")
    if pp_rank >= pp_size:
        raise ChunkOffloadError(f"megatron_plan: pp_rank {pp_rank} is out of range for pp_size {pp_size}")
    m, p = num_microbatches, pp_size
    if vp_size is None or vp_size == 1:
        # No model chunks: p - r - 1 warm-up forwards (none without pipelining), then 1F1B.
        warmup = min(p - pp_rank - 1, m)
        forwards = [Action(F, i, 0) for i in range(m)]
        backwards = [Action(B, i, 0) for i in range(m)]
        steady = [a for i in range(m - warmup) for a in (forwards[warmup + i], backwards[i])]
        source = "megatron 1F1B" if p > 1 else "megatron no-pipelining"
        return Plan(tuple(forwards[:warmup] + steady + backwards[m - warmup :]), pp_rank=pp_rank, pp_size=p, vp_size=1, source=source)

    group = microbatch_group_size_per_vp_stage if microbatch_group_size_per_vp_stage is not None else p
    if not isinstance(vp_size, int) or vp_size < 1 or not isinstance(group, int) or group < 1:
        raise ChunkOffloadError(
            f"megatron_plan needs vp_size and microbatch_group_size_per_vp_stage as ints >= 1, got {vp_size!r} and {group!r}"
        )
    get_pp_rank_microbatches, get_schedule_table = _megatron_tables()
    # get_pp_rank_microbatches reads the pipeline sizes from a P2PCommunicator when one is given;
    # these three attributes are all it reads, so no process group is needed.
    comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: p, rank=lambda: pp_rank), virtual_pipeline_model_parallel_size=vp_size)
    total, _, warmup, remaining = get_pp_rank_microbatches(m, vp_size, group, p2p_communicator=comm)
    table = get_schedule_table(m, vp_size, group)  # virtual microbatch k -> (microbatch, model chunk)
    forwards = [Action(F, mb, chunk) for mb, chunk in table]
    # Backward k runs model chunk vp - 1 - table[k].chunk (get_model_chunk_id(k, forward=False));
    # per chunk, backwards take microbatches in the order their forwards ran.
    backwards, popped = [], [0] * vp_size
    for _, chunk in table:
        chunk = vp_size - 1 - chunk
        backwards.append(Action(B, popped[chunk], chunk))
        popped[chunk] += 1
    steady = [a for k in range(remaining) for a in (forwards[warmup + k], backwards[k])]
    actions = forwards[:warmup] + steady + backwards[total - warmup :]
    return Plan(tuple(actions), pp_rank=pp_rank, pp_size=p, vp_size=vp_size, source=f"megatron interleaved 1F1B (group {group})")


def _megatron_tables():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron warns about missing TE/Apex on import
            from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table
    except ImportError as e:
        raise ChunkOffloadError(
            "plans of Megatron's interleaved schedule need megatron-core: pip install 'chunk-offload[megatron]'"
        ) from e
    return get_pp_rank_microbatches, get_schedule_table
