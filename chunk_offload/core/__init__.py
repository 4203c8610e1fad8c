"""The offload engine in plain torch: streams, host pool, policy, groups, handlers, manager.

Nothing here imports megatron or transformer_engine; integrations build on top.
"""

from .errors import ChunkOffloadError, HappensBeforeError
from .functions import GroupFunctions, build_group_functions
from .group import GroupState, OffloadGroup
from .handler import ChunkKey, ChunkOffloadHandler
from .host_pool import HostBuffer, HostPool, HostPoolStats
from .manager import ModuleOffload, OffloadConfig, OffloadManager
from .policy import OffloadPolicy, is_marked_not_offloadable, mark_not_offloadable
from .schedule_policy import SchedulePolicy
from .stats import GroupStats, IterationRecord, OffloadStats
from .streams import CpuStreams, CudaStreams, Event, Stream, StreamBackend, default_streams

__all__ = [
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
    "is_marked_not_offloadable",
    "mark_not_offloadable",
]
