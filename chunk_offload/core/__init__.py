"""The offload engine in plain torch: streams, host pool, policies, groups, handlers, manager.

Nothing here imports megatron or transformer_engine; integrations build on the names below
(`OffloadManager` and its scopes, `Action`/`ChunkKey`, `SchedulePolicy`, ...). The handler
(`ChunkOffloadHandler`) keeps Transformer Engine's offload-handler protocol; there is no
Transformer Engine integration beyond that protocol.
"""

from .actions import NOTATION, Action, ActionKind, ChunkKey, diff_actions, format_actions
from .config import OffloadConfig
from .errors import ChunkOffloadError, HappensBeforeError
from .group_state import GroupState
from .handler import ChunkOffloadHandler
from .host_pool import HostPool, HostPoolStats
from .group_names import group_members, layer_group_name
from .joins import joins_layer_group
from .manager import OffloadManager
from .marks import ModuleOffload
from .option_table import OPTIONS, Option, check_value, option, parse_bytes
from .ordering import kept_tail, predicted_reload_wait, prefetch_selection, reload_ahead_budget, reload_ahead_selection
from .schedule_policy import SchedulePolicy
from .records import IterationRecord
from .stats import GroupStats, OffloadStats
from .streams import CpuStreams, CudaStreams, Event, Stream, StreamBackend, VectorClocks, default_streams
from .tensor_filter import TensorFilter, is_marked_not_offloadable, mark_not_offloadable

__all__ = [
    "NOTATION",
    "OPTIONS",
    "Action",
    "ActionKind",
    "ChunkKey",
    "ChunkOffloadError",
    "ChunkOffloadHandler",
    "CpuStreams",
    "CudaStreams",
    "Event",
    "GroupState",
    "GroupStats",
    "HappensBeforeError",
    "HostPool",
    "HostPoolStats",
    "IterationRecord",
    "ModuleOffload",
    "OffloadConfig",
    "OffloadManager",
    "OffloadStats",
    "Option",
    "SchedulePolicy",
    "Stream",
    "StreamBackend",
    "TensorFilter",
    "VectorClocks",
    "default_streams",
    "check_value",
    "diff_actions",
    "format_actions",
    "group_members",
    "is_marked_not_offloadable",
    "joins_layer_group",
    "kept_tail",
    "layer_group_name",
    "mark_not_offloadable",
    "option",
    "parse_bytes",
    "predicted_reload_wait",
    "prefetch_selection",
    "reload_ahead_budget",
    "reload_ahead_selection",
]


def __getattr__(name: str) -> object:
    """``OffloadPolicy``, the name of `TensorFilter` until 0.1: a deprecation warning for one release."""
    if name == "OffloadPolicy":
        import warnings

        warnings.warn(
            "chunk_offload.core.OffloadPolicy is deprecated and will be removed in the next release; use "
            "chunk_offload.core.TensorFilter ('policy' names the schedule policy only)",
            DeprecationWarning,
            stacklevel=2,
        )
        return TensorFilter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
