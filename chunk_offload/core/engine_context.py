"""`EngineContext`: what the groups and handlers of one manager share, and the engine's waits by name."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol, Sequence

import torch
from torch.profiler import record_function

from .held_elsewhere import HeldElsewhere
from .host_pool import HostPool
from .option_table import config_default
from .saved import EmptyTensors
from .stats import ResidentBytes, StatsRecorder
from .streams import StreamBackend

__all__ = ["EngineContext", "NO_RANGE", "WAIT_NAMES", "profile_range"]

# The waits the engine issues, by name. Tests remove one at a time through
# `EngineContext.skip_waits` to prove the happens-before checker catches each.
WAIT_NAMES = (
    "offload_after_compute",  # R1: d2h waits on compute before reading saved tensors
    "release_after_offload",  # R2: device originals handed to d2h (`Stream.retain`), or compute waits on d2h, before they are dropped
    "use_after_reload",  # R2: compute waits on h2d before using reloaded tensors
    "reuse_after_reload",  # R3: d2h waits on the last reload of a host buffer before writing it
    "reload_after_alloc",  # R4: h2d waits on compute where the reload buffer was allocated
    "reload_after_offload",  # R4: h2d waits on the offload's event before reading its host buffer
)


@dataclass(kw_only=True, slots=True)
class EngineContext:
    """What groups and handlers share: streams, host pool, policy and counters."""

    streams: StreamBackend
    pool: HostPool
    decide: Callable[[torch.Tensor, Sequence[torch.Tensor]], tuple[bool, int]]
    """`TensorFilter.decide`: whether a saved tensor is offloaded, and its storage key (0 for a
    kept storage no other saved view can be offloaded from)."""
    resident: ResidentBytes
    stats: StatsRecorder
    held_elsewhere: HeldElsewhere
    """Where copies freed nothing, learned at chunk ends (NOTE [Storages held elsewhere])."""
    on_backward_start: Callable[[Any], None] | None = None
    """Called when backward first reaches one of a chunk's groups (after that group's reload)."""
    measure_time: bool = True
    deterministic_memory: bool = False
    """`OffloadConfig.deterministic_memory`: a release waits on the copy instead of handing the
    originals to the copy stream (NOTE [Release by the copy stream])."""
    profile_ranges: bool = False
    """`OffloadConfig.profile_ranges`: name the engine's steps in profiler traces."""
    layer_group_bytes: int | None = None
    """`OffloadConfig.layer_group_bytes`: the bound of a layer group (NOTE [Bounded layer groups] in marks.py)."""
    slab_bytes: int = config_default("OffloadConfig.group_slab_bytes")
    """`OffloadConfig.group_slab_bytes`: the largest group slab (NOTE [Group slabs] in slab.py); 0: none."""
    skip_waits: frozenset[str] = frozenset()
    """Test-only: names from `WAIT_NAMES` whose wait is not issued."""
    empties: EmptyTensors = field(default_factory=EmptyTensors)
    """An empty tensor per device, that the version probes of released originals share."""


NO_RANGE = contextlib.nullcontext()  # stateless: what `profile_range` returns with ranges off


class RangedGroup(Protocol):
    """What `profile_range` reads of a group (an `OffloadGroup`; typed here, below it, so that
    this module does not import the group's)."""

    name: str
    index: int
    handler: Any  # its `ChunkOffloadHandler`: ``ctx`` and ``key``


def profile_range(group: RangedGroup, step: str) -> ContextManager:
    """A `torch.profiler.record_function` range for ``step`` of ``group`` (``offload``,
    ``reload``, ``wait_offload``, ``wait_reload``, ``prefetch``), or a no-op context when
    `OffloadConfig.profile_ranges` is off (no range object is made then)."""
    handler = group.handler
    if not handler.ctx.profile_ranges:
        return NO_RANGE
    key = handler.key
    return record_function(f"chunk_offload::{step} {group.name}[{group.index}] mb={key.microbatch} vp={key.vp_stage}")
