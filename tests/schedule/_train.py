"""Train the core test stack under a plan for one rank, recording every iteration's record."""

from __future__ import annotations

from typing import Literal, Sequence

from chunk_offload import CpuStreams, IterationRecord, OffloadConfig, OffloadManager, SchedulePolicy
from chunk_offload.schedule import Plan
from tests._driver import RunResult
from tests.core._models import MODULE_KINDS, run_schedule

__all__ = ["train_plan"]


def train_plan(
    plan: Plan,
    policy: SchedulePolicy | None = None,
    *,
    offload: bool | None = True,
    iterations: int = 2,
    layers: int = 2,
    kinds: Sequence[str] = MODULE_KINDS,
    seed: int = 7,
    group_by: Literal["call", "module", "layer"] | None = None,
) -> tuple[RunResult, list[IterationRecord]]:
    """`run_schedule` under ``plan`` (all virtual stages in this process, CPU streams with random
    delays); ``offload=None`` trains without any manager (the numerics reference). ``group_by``:
    `OffloadConfig.group_by` (None: its default)."""
    records: list[IterationRecord] = []

    def factory():
        if offload is None:
            return None
        grouping = {} if group_by is None else {"group_by": group_by}
        config = OffloadConfig(min_offload_bytes=1, offload=offload, **grouping)
        return OffloadManager(config, streams=CpuStreams(max_delay_s=1e-4, seed=seed), schedule_policy=policy)

    def after(manager, iteration):
        if manager is not None:
            records.append(manager.last_iteration)

    result = run_schedule(
        factory, order=plan.actions, model_chunks=plan.vp_size, iterations=iterations, layers=layers, kinds=kinds, after_iteration=after
    )
    return result, records
