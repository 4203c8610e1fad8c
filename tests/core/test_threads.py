"""Threads other than the training thread (issue 23): a monitor reading `stats`, a forward on
another thread while a chunk is open, `close` from another thread.

The monitor test makes the interpreter switch threads every few microseconds, so that its reads
land inside the engine's updates; every snapshot must hold the accounting's invariants, and the
run's numbers must be those of a run without a monitor.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import fields

import pytest
import torch
from torch import nn

from chunk_offload import ChunkOffloadError, OffloadConfig, OffloadManager
from tests.core._models import ONE_F_ONE_B, assert_clean, run_schedule

_TIMES = ("offload_time_s", "reload_time_s", "wait_time_s")


def _check_snapshot(stats, previous) -> None:
    assert stats.saved_bytes_at_peak == stats.peak_resident_bytes + stats.host_bytes_at_peak
    assert stats.peak_resident_bytes >= stats.resident_bytes >= 0 and stats.host_bytes >= 0
    assert stats.peak_saved_bytes >= stats.resident_bytes + stats.host_bytes
    for name, group in previous.groups.items():  # counters only grow
        now = stats.groups[name]
        for f in fields(group):
            assert getattr(now, f.name) >= getattr(group, f.name), (name, f.name)


def _train(monitor: bool):
    managers: list[OffloadManager] = []
    records = []
    snapshots: list = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def read(manager: OffloadManager) -> None:
        previous = None
        try:
            while not stop.is_set():
                stats = manager.stats()
                if previous is not None:
                    _check_snapshot(stats, previous)
                previous = stats
                snapshots.append(stats)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    def factory() -> OffloadManager:
        manager = OffloadManager(OffloadConfig(min_offload_bytes=1, measure_time=True))
        managers.append(manager)
        if monitor:
            threading.Thread(target=read, args=(manager,), daemon=True).start()
        return manager

    def after(manager, it) -> None:
        records.append(manager.last_iteration)
        if it == 5:
            stop.set()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    try:
        result = run_schedule(factory, order=ONE_F_ONE_B, iterations=6, after_iteration=after)
    finally:
        stop.set()
        sys.setswitchinterval(switch)
    return result, records, managers[0].stats(), snapshots, errors


def test_stats_read_from_another_thread_while_iterations_run_is_a_consistent_snapshot():
    ref, ref_records, ref_stats, _, _ = _train(monitor=False)
    result, records, final, snapshots, errors = _train(monitor=True)
    assert errors == [], f"the monitor thread failed: {errors[0]!r}"
    assert len(snapshots) > 5, "the monitor read while the iterations ran"
    for a, b in zip(result.losses, ref.losses):
        assert torch.equal(a, b)
    # The same bytes as without a monitor; no copy time lost or counted twice by concurrent folds.
    for name, group in final.groups.items():
        ref_group = ref_stats.groups[name]
        for f in fields(group):
            if f.name not in _TIMES:
                assert getattr(group, f.name) == getattr(ref_group, f.name), (name, f.name)
        for kind in _TIMES:
            per_iteration = sum(getattr(r.groups[name], kind) for r in records)
            assert per_iteration == pytest.approx(getattr(group, kind), rel=1e-9, abs=1e-12), (name, kind)
    assert [r.peak_resident_bytes for r in records] == [r.peak_resident_bytes for r in ref_records]


def test_reset_stats_from_the_training_thread_while_a_monitor_reads():
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    manager.offload_module(module, "m")
    stop, errors = threading.Event(), []

    def read() -> None:
        try:
            while not stop.is_set():
                manager.stats()
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(20):
            with manager.iteration():
                with manager.chunk(microbatch=0):
                    out = module(torch.randn(4, 8, requires_grad=True))
                out.sum().backward()
            manager.reset_stats()
    finally:
        stop.set()
        reader.join(30)
    assert errors == []
    manager.close()


def _offloaded():
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    manager.offload_module(module, "m")
    return manager, module


def _on_thread(fn):
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, name="other")
    thread.start()
    thread.join(30)
    return box


def test_a_forward_on_another_thread_is_not_pulled_into_the_open_chunk():
    manager, module = _offloaded()
    with manager.iteration():
        with manager.chunk(microbatch=0) as handler:
            other = _on_thread(lambda: module(torch.randn(3, 4, requires_grad=True)))
            assert "error" not in other
            assert handler.groups == [], "the other thread's forward opened no group in this chunk"
            assert manager.current_handler is handler
            assert _on_thread(lambda: manager.current_handler) == {"value": None}
            out = module(torch.randn(3, 4, requires_grad=True))
        assert [g.name for g in handler.groups] == ["m"]
        out.sum().backward()
        other["value"].sum().backward()  # its graph saved nothing through the manager
    assert manager.stats().groups["m"].groups == 1
    assert_clean(manager)
    manager.close()


def test_group_marks_on_another_thread_are_outside_the_chunk():
    manager, _ = _offloaded()
    x = torch.randn(4, requires_grad=True)
    with manager.iteration():
        with manager.chunk(microbatch=0) as handler:
            box = _on_thread(lambda: manager.group_commit(manager.group_start(x, "g").sin(), "g"))
            assert "error" not in box and handler.groups == []
    manager.close()


def test_a_chunk_begun_or_ended_on_another_thread_while_one_is_open_is_refused():
    manager, _ = _offloaded()
    with manager.iteration():
        with manager.chunk(microbatch=0):
            begun = _on_thread(lambda: manager.begin_chunk(microbatch=1))
            assert isinstance(begun["error"], ChunkOffloadError)
            assert "inside chunk (microbatch=0, vp_stage=0) open on another thread" in str(begun["error"])
            ended = _on_thread(manager.end_chunk)
            assert isinstance(ended["error"], ChunkOffloadError)
            assert "end_chunk() on another thread than the one that began chunk" in str(ended["error"])
    assert_clean(manager)
    manager.close()


def test_close_from_another_thread_during_an_iteration_is_refused_with_both_threads_named():
    manager, module = _offloaded()
    with manager.iteration():
        with manager.chunk(microbatch=0):
            out = module(torch.randn(3, 4, requires_grad=True))
            box = _on_thread(manager.close)
        message = str(box["error"])
        assert message.startswith("chunk_offload: close() called on thread 'other' while an iteration is open")
        assert f"on thread {threading.current_thread().name!r} (the training thread)" in message
        assert not manager.closed
        out.sum().backward()
    assert _on_thread(manager.close) == {"value": None}  # between iterations any thread may close it
    assert manager.closed


class _Interleaving(nn.Module):
    """On the main thread, its forward lets another thread enter the same module and leaves it
    before that thread does: main pre, other pre, main post, other post."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.entered = threading.Event()
        self.main_left = threading.Event()
        self.other: threading.Thread | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).tanh()
        if threading.current_thread() is threading.main_thread():
            self.other = threading.Thread(target=lambda: self(torch.randn(3, 4, requires_grad=True)))
            self.other.start()
            assert self.entered.wait(30)
        else:
            self.entered.set()
            assert self.main_left.wait(30)
        return y * 2


def test_interleaved_forwards_of_one_module_on_two_threads_keep_their_own_groups():
    manager = OffloadManager(OffloadConfig(min_offload_bytes=1))
    module = _Interleaving()
    manager.offload_module(module, "m")
    with manager.iteration():
        with manager.chunk(microbatch=0) as handler:
            out = module(torch.randn(3, 4, requires_grad=True))
            module.main_left.set()
            module.other.join(30)
        assert [g.name for g in handler.groups] == ["m"]
        out.sum().backward()
    assert_clean(manager)
    manager.close()
