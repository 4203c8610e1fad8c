"""`gather_reports`: one report without a process group; all of them, sorted, on rank 0 of 2 gloo ranks."""

from __future__ import annotations

import torch.distributed as dist

from chunk_offload.report import gather_reports
from tests._spawn import run_ranks

from ._reports import sample_report

WORLD_SIZE = 2


def test_without_a_process_group_it_returns_the_report_alone():
    assert not dist.is_initialized()
    report = sample_report(0)
    assert gather_reports(report) == [report]


def _gather(rank: int, world_size: int):
    # The ranks call in the opposite order of their rank numbers' reports: sorting is the gather's job.
    return gather_reports(sample_report(world_size - 1 - rank))


def test_rank_zero_gets_every_report_sorted_by_rank():
    on_zero, on_one = run_ranks(_gather, world_size=WORLD_SIZE, timeout_s=60.0, what="report ranks")
    assert on_zero == [sample_report(0), sample_report(1)]
    assert on_one is None
