"""`build_stage_report`: a Megatron rank's `StageReport` from what its training session recorded.

The `TrainingSession` keeps the `IterationRecord` of its first ``baseline_iterations`` training calls, which
ran without copies, and of its latest call (``session.records``). The report compares the first
baseline record with the latest one and takes the theoretical drop from the rank's Megatron
plan (``session.plan``) simulated with the recorded bytes per group, under the session's own
schedule policy, the one its latest record ran under (NOTEs [Report measure] and [Theoretical drop] in `chunk_offload/report/stage.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist

from ...core import ChunkOffloadError
from ...report.files import ReportFiles, write_report
from ...report.gather import gather_reports
from ...report.stage import StageReport, stage_report

if TYPE_CHECKING:
    from ..session import TrainingSession

__all__ = ["Reporting", "build_stage_report", "write_rank_reports"]


class Reporting(Protocol):
    """What `write_rank_reports` reads: a `MegatronOffloadManager`."""

    def report(self) -> StageReport: ...


def build_stage_report(session: "TrainingSession") -> StageReport:
    """This rank's report from a `TrainingSession` (or the manager that holds it) that ran a
    baseline and an offload iteration.

    Local only: collect the ranks' reports with `chunk_offload.report.gather_reports`.
    Raises `ChunkOffloadError` when the manager has no baseline or no offload iteration yet.
    """
    # records: the baseline iterations' records (the first training calls), then the latest call's.
    records = list(session.records)
    baseline = next((i for i, r in enumerate(records) if not r.offload), None)
    if baseline is None:
        raise ChunkOffloadError(
            f"the report compares an iteration without offload with one with it, but all {len(records)} recorded "
            "iterations ran with offload; attach with baseline_iterations=1 (--chunk-offload-report sets it)"
        )
    if not records[-1].offload:
        raise ChunkOffloadError(
            f"the report needs an iteration with offload, but all {len(records)} recorded iterations were baselines; "
            "train more iterations than baseline_iterations, without offload=False (--chunk-offload-baseline)"
        )
    plan = session.plan
    if plan is None:
        raise ChunkOffloadError("the manager has no plan yet: run a training iteration first (through manager.wrap(...), or with iterations='auto')")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return stage_report(
        baseline=records[baseline],
        offloaded=records[-1],
        plan=plan,
        rank=rank,
        policy=session.tracking.ran_policy if session.tracking.ran_policy is not None else session.engine.schedule_policy,
        baseline_iteration=baseline,
        offload_iteration=session.training_calls - 1,  # the latest training call
        budgets=session.tracking.budgets.summary(records[-1]) if session.tracking.budgets.active else None,
    )


def write_rank_reports(manager: Reporting, path: str | Path) -> ReportFiles | None:
    """Gather every rank's report to rank 0 and write it there (`write_report`); a collective.

    What a training loop does after training with ``--chunk-offload-report PATH`` (the
    ``chunk_offload.megatron_lm`` launcher calls it after ``pretrain``). Returns the files on
    rank 0, None on the others.
    """
    reports = gather_reports(manager.report())
    return None if reports is None else write_report(reports, path)
