"""`chunk_offload.devkit.host_profile`: per-function calls and own time, an engine's share, and the difference of two runs."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from chunk_offload.devkit.host_profile import API_FILE, GcClock, api_calls, engine_files, format_rows, over, own_times

THIS_FILE = __file__


def _leaf(n: int) -> int:
    return sum(range(n))


def _work(calls: int):
    def work() -> None:
        for _ in range(calls):
            _leaf(200)

    return work


def test_calls_are_counted_per_step_and_subtracted_exactly() -> None:
    seven, seven_spent = own_times(_work(7), steps=3, engine=lambda file: file == THIS_FILE)
    three, _ = own_times(_work(3), steps=3)
    key = next(k for k in seven if k[2] == "_leaf")
    assert seven[key][0] == 7 and three[key][0] == 3
    assert over(seven, three)[key][0] == 4
    # This file's functions and the C calls they make (sum, range) are the engine here.
    own_here = sum(own for (file, _, _), (_, own) in seven.items() if file == THIS_FILE)
    assert seven_spent > own_here > 0
    rows = format_rows({key: seven[key]}, per=7)
    assert len(rows) == 1 and rows[0].split()[1] == "1.00" and rows[0].endswith(f"_leaf (test_host_profile.py:{key[1]})")


def test_profiled_backward_runs_on_the_calling_thread() -> None:
    """Autograd runs a CUDA backward on a device thread cProfile does not see: profiled steps turn that off."""
    seen = []
    x = torch.ones(3, requires_grad=True)

    def work() -> None:
        seen.append(torch.autograd.is_multithreading_enabled())
        (x * 2).sum().backward()

    times, _ = own_times(work, steps=2)
    assert seen == [False, False] and torch.autograd.is_multithreading_enabled()  # restored after
    assert any(name == "<method 'run_backward' of 'torch._C._EngineBase' objects>" for _, _, name in times)


def test_a_function_only_in_the_baseline_counts_negative() -> None:
    a = {("f.py", 1, "f"): (2, 0.5)}
    b = {("g.py", 2, "g"): (1, 0.25)}
    assert over(a, b) == {("f.py", 1, "f"): (2, 0.5), ("g.py", 2, "g"): (-1, -0.25)}


def test_api_rows_are_the_host_side_cuda_calls_and_print_by_name() -> None:
    """`api_calls` keeps torch.profiler's host-side CUDA runtime and driver rows, not operators or device activities."""

    def row(key: str, count: int, us: float, device: DeviceType = DeviceType.CPU) -> SimpleNamespace:
        return SimpleNamespace(key=key, count=count, cpu_time_total=us, device_type=device)

    averages = [
        row("cudaMemcpyAsync", 8, 40.0),
        row("cuLaunchKernel", 3, 9.0),
        row("aten::copy_", 8, 120.0),  # an operator: its time is in the cProfile rows
        row("cutlass_80_tensorop_gemm", 3, 0.0, DeviceType.CUDA),  # a kernel on the device's timeline
        row("Memcpy DtoH (Device -> Pinned)", 8, 0.0, DeviceType.CUDA),
    ]
    calls = api_calls(averages)
    assert calls == {(API_FILE, 0, "cudaMemcpyAsync"): (8, 40e-6), (API_FILE, 0, "cuLaunchKernel"): (3, 9e-6)}
    rows = format_rows(over(calls, {(API_FILE, 0, "cuLaunchKernel"): (1, 3e-6)}), per=2)
    assert [r.split() for r in rows] == [["20.00", "4.00", "cudaMemcpyAsync"], ["3.00", "1.00", "cuLaunchKernel"]]


def test_gc_clock_counts_the_collections_run_while_entered() -> None:
    callbacks = len(gc.callbacks)
    with GcClock() as clock:
        gc.collect(1)
        gc.collect()
    gc.collect()  # after the clock: not counted
    assert clock.collections == [0, 1, 1] and clock.seconds > 0
    assert len(gc.callbacks) == callbacks


def test_engine_files_name_each_engine_and_refuse_an_unknown_one() -> None:
    ours = engine_files("chunk_offload")
    assert ours("/x/chunk_offload/core/group.py") and ours("/x/chunk_offload/integrations/megatron/manager.py")
    assert not ours("/x/chunk_offload/devkit/gpt.py") and not ours("/x/chunk_offload/replay/run.py")
    assert not ours("/x/megatron/core/pipeline_parallel/fine_grained_activation_offload.py")
    megatron = engine_files("megatron")
    assert megatron("/x/megatron/core/pipeline_parallel/fine_grained_activation_offload.py")
    assert not megatron("/x/chunk_offload/core/group.py") and not megatron("/x/megatron/core/transformer/transformer_layer.py")
    with pytest.raises(ValueError, match=r"engine_files: engine must be one of chunk_offload, megatron, got 'deepspeed'"):
        engine_files("deepspeed")


def test_a_busy_profiler_is_a_warning_and_no_time(monkeypatch, caplog) -> None:
    """Under another profiler (Python 3.12 refuses a second cProfile) nothing is profiled or run twice."""
    import cProfile

    from chunk_offload.devkit.host_profile import engine_host_time

    def busy(self) -> None:
        raise ValueError("Another profiling tool is already active")

    ran = []
    monkeypatch.setattr(cProfile.Profile, "enable", busy)
    assert engine_host_time(lambda: ran.append(1), 2, "megatron") is None
    assert ran == []
    assert "megatron's host time is not measured: cProfile cannot start: Another profiling tool is already active" in caplog.text
    assert engine_host_time(lambda: ran.append(1), 0, "megatron") is None and ran == []
