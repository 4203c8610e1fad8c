"""`AttachedManager`: what an integration's manager is, over a composed `OffloadManager`.

An integration binds an engine (`chunk_offload.core.OffloadManager`, held as ``engine``, not
subclassed) to a framework's model chunks or pipeline stages, and drives its scopes
(`begin_iteration` / `end_iteration`, `begin_chunk` / `end_chunk`) from hooks. This base
holds the engine and the `PlanTracking` (which owns the device and host budget decisions, see
`budgets.py`), forwards the engine's user-facing results (`stats`,
`last_iteration`, `live_chunks`, `close`, ...) and removes the module hooks on `detach`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist
from torch import nn

from ..core import (
    ChunkKey,
    HostPool,
    IterationRecord,
    OffloadConfig,
    OffloadManager,
    OffloadStats,
    SchedulePolicy,
    StreamBackend,
)
from ..schedule import Plan
from .budgets import Budgets
from .plan_tracking import PlanTracking

__all__ = ["AttachedManager", "ScheduleOptions"]


@dataclass(kw_only=True, slots=True)
class ScheduleOptions:
    """The schedule and budget keywords every integration's ``attach`` takes (checked by `PlanTracking`).

    ``schedule_policy``: ``"plan"`` (decisions from the rank's plan), None (reload at group start)
    or a `SchedulePolicy`. ``prefetch_bytes`` / ``reload_ahead_bytes``: `PlanPolicy`'s budgets.
    ``device_budget_bytes``: bytes this rank's device may use (an int, or ``"auto"``: the smallest
    budget every pipeline rank meets), see `budgets.py`. ``host_budget_bytes``: pinned host bytes
    of the whole node, split among its ranks by need.
    """

    schedule_policy: SchedulePolicy | Literal["plan"] | None = "plan"
    prefetch_bytes: int | None = None
    reload_ahead_bytes: int | None = None
    device_budget_bytes: int | Literal["auto"] | None = None
    host_budget_bytes: int | None = None



class AttachedManager:
    """An `OffloadManager` (``engine``) bound to one rank's model, with the rank's plan."""

    def __init__(
        self,
        *,
        config: OffloadConfig | None,
        streams: StreamBackend | None,
        options: ScheduleOptions,
        pipeline_group: dist.ProcessGroup | None = None,
        blocking_exchanges: bool = True,
    ) -> None:
        # Every argument is checked before the engine starts its streams.
        self.tracking = PlanTracking(options)
        self.engine = OffloadManager(config, streams=streams, schedule_policy=self.tracking.engine_policy)
        """The offload engine this integration drives."""
        self.tracking.bind(self.engine, pipeline_group=pipeline_group, blocking=blocking_exchanges)

    # ------------------------------------------------------------------ the engine's results
    @property
    def plan(self) -> Plan | None:
        """This rank's plan (see the integration's NOTE on observed orders)."""
        return self.tracking.plan

    @property
    def budgets(self) -> Budgets:
        """The rank's device and host budget decisions: ``choice``, ``leveled_budget``, ``host_cap``, ..."""
        return self.tracking.budgets

    @property
    def config(self) -> OffloadConfig:
        return self.engine.config

    @property
    def streams(self) -> StreamBackend:
        return self.engine.streams

    @property
    def pool(self) -> HostPool:
        return self.engine.pool

    @property
    def schedule_policy(self) -> SchedulePolicy:
        """The engine's current schedule policy."""
        return self.engine.schedule_policy

    @property
    def last_iteration(self) -> IterationRecord | None:
        """`OffloadManager.last_iteration`."""
        return self.engine.last_iteration

    @property
    def current_handler(self):
        """`OffloadManager.current_handler`."""
        return self.engine.current_handler

    def stats(self) -> OffloadStats:
        """`OffloadManager.stats`."""
        return self.engine.stats()

    def reset_stats(self) -> None:
        """`OffloadManager.reset_stats`."""
        self.engine.reset_stats()

    def live_chunks(self) -> list[ChunkKey]:
        """`OffloadManager.live_chunks`."""
        return self.engine.live_chunks()

    def group_bytes(self) -> dict[tuple[int, int], list[int]]:
        """`OffloadManager.group_bytes`."""
        return self.engine.group_bytes()

    def protect_module(self, module: nn.Module) -> None:
        """`OffloadManager.protect_module`."""
        self.engine.protect_module(module)

    def close(self) -> None:
        """`OffloadManager.close`."""
        self.engine.close()

    def _remove_module_offloads(self) -> None:
        """Remove the module hooks of every `offload_module` registration (detach)."""
        for registration in self.engine.module_offloads:
            registration.remove()
