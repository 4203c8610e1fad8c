"""`AttachedManager`: what an integration's manager is, over a `TrainingSession`.

An integration binds a `TrainingSession` (which composes the engine, a
`chunk_offload.core.OffloadManager` held as ``engine``, not subclassed) to a framework's model
chunks or pipeline stages, and translates the framework's events into session calls from hooks.
This base holds the session, forwards the engine's user-facing results (`stats`,
`last_iteration`, `live_chunks`, `close`, ...) and removes the module hooks on `detach`.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

from torch import nn

from ..core import (
    Action,
    ChunkKey,
    HostPool,
    IterationRecord,
    OffloadConfig,
    OffloadStats,
    SchedulePolicy,
    StreamBackend,
)
from ..schedule import Plan
from .budgets import Budgets
from .options import ScheduleOptions
from .session import TrainingSession

__all__ = ["AttachedManager", "ScheduleOptions", "alive"]


def alive(refs: Sequence[weakref.ref]) -> list[Any]:
    """The objects of ``refs`` still alive, in order. An integration holds the model it is attached to
    (chunks, schedule, stages) through weak references: the model's hooks hold the manager, never the
    other way, so that a manager kept after its model is dropped keeps no model alive."""
    return [obj for obj in (ref() for ref in refs) if obj is not None]


class AttachedManager:
    """An `OffloadManager` (``engine``) bound to one rank's model, with the rank's plan, through a `TrainingSession`."""

    def __init__(self, session: TrainingSession) -> None:
        self.session = session
        """The rank's training lifecycle: plan tracking, records and the after-iteration sequence."""
        self.engine = self.session.engine
        """The offload engine this integration drives."""
        self.tracking = self.session.tracking

    # ------------------------------------------------------------------ the session's results
    @property
    def plan(self) -> Plan | None:
        """This rank's plan (see the integration's NOTE on observed orders)."""
        return self.session.plan

    @property
    def budgets(self) -> Budgets:
        """The rank's device and host budget decisions: ``choice``, ``leveled_budget``, ``host_cap``, ..."""
        return self.tracking.budgets

    @property
    def observed_order(self) -> list[Action]:
        """The actions of the last training iteration, as they ran."""
        return self.session.observed_order

    @property
    def records(self) -> list[IterationRecord]:
        """The baseline iterations' records, then the last later iteration's."""
        return self.session.records

    @property
    def ran_policy(self) -> SchedulePolicy | None:
        """The schedule policy the latest complete training iteration ran under (None: none yet)."""
        return self.tracking.ran_policy

    @property
    def baseline_iterations(self) -> int:
        """The first training iterations that run without copies."""
        return self.session.baseline_iterations

    @property
    def training_calls(self) -> int:
        """Training iterations completed so far."""
        return self.session.training_calls

    # ------------------------------------------------------------------ the engine's results
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
        """Remove the module hooks of every `offload_module` registration and forget the protected
        modules (detach): a detached manager holds nothing of the model, which may then be freed
        while the manager is kept (its records, stats and report stay)."""
        for registration in self.engine.module_offloads:
            registration.remove()
        self.engine.tensor_filter.forget_protected()
