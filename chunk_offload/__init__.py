"""chunk-offload: move activations saved for backward to host memory, per pipeline chunk.

Public API: the names in ``__all__``. Everything else (modules starting with ``_``, the
group state machine's internals, `chunk_offload.core.group.SavedRef`) is internal and may
change without notice. Subpackages with their own public API:

- ``chunk_offload.schedule``: plans (`Plan`, `megatron_plan`), `PlanPolicy`, `simulate`;
- ``chunk_offload.report``: the per-stage memory report;
- ``chunk_offload.planner``: the analytic planner (also the ``chunk-offload plan`` command);
- ``chunk_offload.replay``: one pipeline stage of a large job on one device;
- ``chunk_offload.integrations.megatron`` and ``chunk_offload.pipelining``: the integrations.
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
