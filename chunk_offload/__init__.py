"""chunk-offload: move activations saved for backward to host memory, per pipeline chunk.

Public API: the names in ``__all__`` (the product). Everything else is reached through its
subpackage, each with its own ``__all__``:

- ``chunk_offload.core``: the engine's parts (handlers, groups, host pool, ordering rules,
  `Action`/`ChunkKey`), for integrations and tests;
- ``chunk_offload.schedule``: plans (`Plan`, `megatron_plan`), `PlanPolicy`, `simulate`;
- ``chunk_offload.report``: the per-stage memory report;
- ``chunk_offload.planner``: the analytic planner (also the ``chunk-offload plan`` command);
- ``chunk_offload.replay``: one pipeline stage of a large job on one device;
- ``chunk_offload.integrations.megatron`` and ``chunk_offload.integrations.pipelining``: the integrations;
- ``chunk_offload.devkit``: CPU-development infrastructure (not part of the product).

`verify_bit_identity` (with `TrainingJob`, `BitIdentityResult`, `Mismatch`, `all_gather_results`)
lives in ``chunk_offload.bit_identity``, whose other names (`StepRecord`, `compare_records`, ...)
serve the launcher's ``--chunk-offload-verify``; import those five from here.
"""

from .bit_identity import BitIdentityResult, Mismatch, TrainingJob, all_gather_results, verify_bit_identity

from .core import (
    ChunkOffloadError,
    CpuStreams,
    CudaStreams,
    GroupStats,
    HappensBeforeError,
    HostPoolStats,
    IterationRecord,
    OffloadConfig,
    OffloadManager,
    OffloadStats,
    SchedulePolicy,
    StreamBackend,
    default_streams,
    mark_not_offloadable,
)

__version__ = "0.1.0"

__all__ = [
    "BitIdentityResult",
    "ChunkOffloadError",
    "CpuStreams",
    "CudaStreams",
    "GroupStats",
    "HappensBeforeError",
    "HostPoolStats",
    "IterationRecord",
    "Mismatch",
    "OffloadConfig",
    "OffloadManager",
    "OffloadStats",
    "SchedulePolicy",
    "StreamBackend",
    "TrainingJob",
    "all_gather_results",
    "default_streams",
    "mark_not_offloadable",
    "verify_bit_identity",
]
