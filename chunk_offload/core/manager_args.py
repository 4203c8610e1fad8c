"""The checks of `OffloadManager`'s arguments: each error names the argument, its value and what is accepted."""

from __future__ import annotations

import dataclasses

from torch import nn

from .config import OffloadConfig
from .errors import ChunkOffloadError
from .schedule_policy import SchedulePolicy
from .streams import StreamBackend

__all__ = ["check_begin_chunk", "check_begin_iteration", "check_flag", "check_manager_args", "check_module", "checked_regroup"]


def check_manager_args(config: object, streams: object, schedule_policy: object) -> OffloadConfig:
    """The validated config (None: the defaults); `ChunkOffloadError` for an argument of a wrong type."""
    if config is None:
        config = OffloadConfig()
    if not isinstance(config, OffloadConfig):
        raise ChunkOffloadError(
            f"config must be an OffloadConfig (fields {OffloadConfig.field_names()}), got {type(config).__name__} {config!r:.200}"
        )
    config.validate()
    if schedule_policy is not None and not isinstance(schedule_policy, SchedulePolicy):
        raise ChunkOffloadError(
            f"schedule_policy must be a chunk_offload SchedulePolicy (e.g. chunk_offload.schedule.PlanPolicy), "
            f"got {type(schedule_policy).__name__}"
        )
    if streams is not None and not isinstance(streams, StreamBackend):
        raise ChunkOffloadError(
            f"OffloadManager(streams=...) takes a StreamBackend (CudaStreams, CpuStreams) or None, got {streams!r}"
        )
    return config


def check_begin_chunk(microbatch: object, vp_stage: object, *, in_iteration: bool, open_key: object, open_here: bool) -> None:
    """``begin_chunk`` inside an iteration, outside another chunk (``open_key``: the open one's,
    ``open_here``: opened on the calling thread), with ids that are ints >= 0 (not bools)."""
    if not in_iteration:
        raise ChunkOffloadError("chunk() must be used inside `with manager.iteration():`.")
    if open_key is not None:
        where = "" if open_here else " open on another thread (one chunk at a time per manager)"
        raise ChunkOffloadError(
            f"chunk(microbatch={microbatch}, vp_stage={vp_stage}) entered inside chunk {open_key}{where}; chunks cannot nest."
        )
    for label, value in (("microbatch", microbatch), ("vp_stage", vp_stage)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ChunkOffloadError(f"chunk() needs {label} as an int >= 0, got {value!r}")


def check_begin_iteration(*, closed: bool, in_iteration: bool, offload: object) -> None:
    """``begin_iteration`` on an open manager, outside another iteration, ``offload`` True, False or None."""
    if closed:
        raise ChunkOffloadError("iteration() on a closed OffloadManager; create a new manager.")
    if in_iteration:
        raise ChunkOffloadError("iteration() entered while an iteration is already open; they cannot nest.")
    if offload is not None and not isinstance(offload, bool):
        raise ChunkOffloadError(f"iteration(offload=...) takes True, False or None, got {offload!r}")


def check_flag(call: str, name: str, value: object) -> None:
    """A keyword switch such as ``end_chunk(abort=...)`` is True or False (a string would be truthy)."""
    if not isinstance(value, bool):
        raise ChunkOffloadError(f"{call}({name}=...) takes True or False, got {value!r}")


def check_module(call: str, module: object) -> None:
    """``module`` is an ``nn.Module`` (checked before anything keeps it)."""
    if not isinstance(module, nn.Module):
        raise ChunkOffloadError(f"{call} expects an nn.Module, got {type(module).__name__} {module!r:.80}")


def checked_regroup(config: OffloadConfig, layer_group_bytes: object, *, in_iteration: bool) -> OffloadConfig:
    """`OffloadManager.regroup`'s config: ``config`` with ``layer_group_bytes``, refused inside an
    iteration (its open chunks group by the bound they started with) or under another ``group_by``."""
    if in_iteration:
        raise ChunkOffloadError("regroup() while an iteration is open; call it between iterations.")
    if config.group_by != "layer":
        raise ChunkOffloadError(f"regroup() bounds layer groups: it needs OffloadConfig.group_by='layer', got {config.group_by!r}")
    regrouped = dataclasses.replace(config, layer_group_bytes=layer_group_bytes)
    regrouped.validate()
    return regrouped
