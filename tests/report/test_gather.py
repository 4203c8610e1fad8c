"""`gather_reports`: one report without a process group; all of them, sorted, on rank 0 of 2 gloo ranks."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chunk_offload.report import gather_reports

from ._reports import sample_report

WORLD_SIZE = 2


def test_without_a_process_group_it_returns_the_report_alone():
    assert not dist.is_initialized()
    report = sample_report(0)
    assert gather_reports(report) == [report]


def _child(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=60))
    try:
        # The ranks call in the opposite order of their rank numbers' reports: sorting is the gather's job.
        got = gather_reports(sample_report(WORLD_SIZE - 1 - rank))
        torch.save(got, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_rank_zero_gets_every_report_sorted_by_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_child, args=(port, out_dir), nprocs=WORLD_SIZE, start_method="spawn", join=True)
        on_zero = torch.load(Path(out_dir) / "rank0.pt", weights_only=False)
        on_one = torch.load(Path(out_dir) / "rank1.pt", weights_only=False)
    assert on_zero == [sample_report(0), sample_report(1)]
    assert on_one is None
