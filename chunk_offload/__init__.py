"""chunk-offload: move activations saved for backward to host memory, per pipeline chunk.

Public API: the names in ``__all__``. Everything else (modules starting with ``_``, the
group state machine's internals, `chunk_offload.core.group.SavedRef`) is internal and may
change without notice. Integrations live in ``chunk_offload.integrations``; plans and
schedule-driven decisions in ``chunk_offload.schedule``.
"""

from .core import (
    ChunkKey,
    ChunkOffloadError,
    ChunkOffloadHandler,
    CpuStreams,
    CudaStreams,
    GroupStats,
    HappensBeforeError,
    HostPool,
    HostPoolStats,
    IterationRecord,
    OffloadConfig,
    OffloadManager,
    OffloadStats,
    SchedulePolicy,
    build_group_functions,
    default_streams,
    mark_not_offloadable,
)

__version__ = "0.1.0"

__all__ = [
    "ChunkKey",
    "ChunkOffloadError",
    "ChunkOffloadHandler",
    "CpuStreams",
    "CudaStreams",
    "GroupStats",
    "HappensBeforeError",
    "HostPool",
    "HostPoolStats",
    "IterationRecord",
    "OffloadConfig",
    "OffloadManager",
    "OffloadStats",
    "SchedulePolicy",
    "build_group_functions",
    "default_streams",
    "mark_not_offloadable",
]
