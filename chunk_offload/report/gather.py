"""`gather_reports`: every rank's `StageReport` onto rank 0, as one explicit collective call."""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist

from .stage import StageReport

__all__ = ["gather_objects", "gather_reports"]

T = TypeVar("T")


def gather_objects(item: T, *, group: Any = None) -> list[T] | None:
    """Collect one picklable ``item`` per rank of ``group`` (default: the world) on its first rank.

    A collective: every rank of ``group`` must call it. Returns the items in rank order on the
    group's first rank and None on the others; without an initialised process group (a single
    process) ``[item]``.
    """
    if not dist.is_available() or not dist.is_initialized():
        return [item]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, item, group=group)
    return gathered if dist.get_rank(group) == 0 else None


def gather_reports(report: StageReport, *, group: Any = None) -> list[StageReport] | None:
    """Collect the reports of all ranks of ``group`` (default: the world) on its first rank.

    A collective: every rank of ``group`` must call it. Returns the reports sorted by rank on
    the group's first rank and None on the others. Without an initialised process group (a
    single process) it returns ``[report]``.
    """
    gathered = gather_objects(report, group=group)
    return None if gathered is None else sorted(gathered, key=lambda r: r.rank)
