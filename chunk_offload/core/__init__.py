"""The offload engine in plain torch: streams, host pool, policy, groups, handlers, manager.

Nothing here imports megatron or transformer_engine; integrations build on top.
"""

from .errors import ChunkOffloadError, HappensBeforeError
from .functions import GroupFunctions, build_group_functions
from .group import GroupState, OffloadGroup
from .actions import Action, ActionKind, ChunkKey, diff_actions, format_actions
from .handler import ChunkOffloadHandler
from .host_pool import HostBuffer, HostPool, HostPoolStats
from .config import OffloadConfig
from .manager import OffloadManager
from .marks import ModuleOffload
from .policy import OffloadPolicy, is_marked_not_offloadable, mark_not_offloadable
from .schedule_policy import SchedulePolicy
from .stats import GroupStats, IterationRecord, OffloadStats
from .streams import CpuStreams, CudaStreams, Event, Stream, StreamBackend, default_streams

__all__ = [
    "Action",
    "ActionKind",
    "ChunkKey",
    "ChunkOffloadError",
    "ChunkOffloadHandler",
    "CpuStreams",
    "CudaStreams",
    "Event",
    "GroupFunctions",
    "GroupState",
    "GroupStats",
    "HappensBeforeError",
    "HostBuffer",
    "HostPool",
    "HostPoolStats",
    "IterationRecord",
    "ModuleOffload",
    "OffloadConfig",
    "OffloadGroup",
    "OffloadManager",
    "OffloadPolicy",
    "OffloadStats",
    "SchedulePolicy",
    "Stream",
    "StreamBackend",
    "build_group_functions",
    "default_streams",
    "diff_actions",
    "format_actions",
    "is_marked_not_offloadable",
    "mark_not_offloadable",
]
