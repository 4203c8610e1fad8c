"""NOTE [Action times] on a real device: the action starts a `CopyTiming` reads are the device's.

Between two chunks' forwards the device sleeps (``torch.cuda._sleep``, queued: the host goes on at
once). The record's action starts must show the sleep, which host times would not.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine: bash bench/gpu_evidence.sh)")


def _sleep_cycles(seconds: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the device busy about ``seconds``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe = 10_000_000
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * seconds / (start.elapsed_time(end) / 1000.0))


def test_action_starts_are_read_on_the_device(make_manager) -> None:
    layer = nn.Linear(256, 256).cuda()
    x = torch.randn(64, 256, device="cuda")
    cycles = _sleep_cycles(0.05)
    with contextlib.closing(make_manager(min_offload_bytes=1)) as manager:  # measure_time: device marks
        manager.offload_module(layer, "layer")
        with manager.iteration():
            with manager.chunk(microbatch=0):
                first = layer(x)
            issued = time.perf_counter()
            torch.cuda._sleep(cycles)
            host_gap = time.perf_counter() - issued
            with manager.chunk(microbatch=1):
                second = layer(x)
            (first.sum() + second.sum()).backward()
        record = manager.last_iteration
    assert [str(a) for a in record.order[:2]] == ["0F0", "0F1"], record.order
    starts = record.action_starts_s
    assert starts == sorted(starts) and starts[0] >= 0.0 and starts[-1] <= record.wall_time_s
    device_gap = starts[1] - starts[0]
    assert device_gap >= 0.04 and host_gap < 0.02, (device_gap, host_gap)
