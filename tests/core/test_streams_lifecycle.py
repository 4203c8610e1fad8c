"""`CpuStreams` set-up and lifetime: option checks, the CPU default, closing and collecting a
backend (its worker threads end), timed work, public names."""

from __future__ import annotations

import gc
import time

import pytest
import torch

import chunk_offload
from chunk_offload import ChunkOffloadError, CpuStreams, HappensBeforeError, default_streams
from tests.core._streams import JOIN_TIMEOUT_S, worker_threads


def test_invalid_delay_on_lists_valid_names():
    with pytest.raises(ChunkOffloadError, match=r"delay_on names unknown streams \['gpu'\]; valid: \['compute', 'd2h', 'h2d'\]"):
        CpuStreams(delay_on=("d2h", "gpu"))


def test_negative_max_delay_is_rejected():
    with pytest.raises(ChunkOffloadError, match=r"CpuStreams\(max_delay_s=...\) takes a finite number of seconds >= 0, got -0.5"):
        CpuStreams(max_delay_s=-0.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_default_streams_without_cuda_are_cpu_streams():
    before = worker_threads()
    backends = [default_streams(), default_streams("cpu"), default_streams(torch.device("cpu"))]
    threads = worker_threads() - before
    try:
        for backend in backends:
            assert type(backend) is CpuStreams
            assert backend.device == torch.device("cpu")
            assert backend.pin_memory is False
        assert len(threads) == 2 * len(backends)
    finally:
        for backend in backends:
            backend.close()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
        assert not thread.is_alive()


def test_close_stops_exactly_this_backends_worker_threads():
    before = worker_threads()
    first = CpuStreams()
    first_threads = worker_threads() - before
    second = CpuStreams()
    second_threads = worker_threads() - before - first_threads
    assert sorted(t.name for t in first_threads) == ["chunk_offload-d2h", "chunk_offload-h2d"]
    assert sorted(t.name for t in second_threads) == ["chunk_offload-d2h", "chunk_offload-h2d"]
    try:
        first.d2h.launch(lambda: time.sleep(0.02))
        first.close()
        first.close()  # idempotent
        for thread in first_threads:
            thread.join(JOIN_TIMEOUT_S)
            assert not thread.is_alive(), f"{thread.name} of the closed backend still runs"
        assert all(t.is_alive() for t in second_threads), "closing one backend stopped another's workers"
        done: list[int] = []
        second.h2d.launch(lambda: done.append(1))
        second.synchronize()
        assert done == [1]
    finally:
        second.close()
    for thread in second_threads:
        thread.join(JOIN_TIMEOUT_S)
        assert not thread.is_alive()


def test_worker_threads_stop_when_the_backend_is_garbage_collected():
    before = worker_threads()
    backend = CpuStreams()
    threads = worker_threads() - before
    assert len(threads) == 2
    del backend
    gc.collect()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
        assert not thread.is_alive()


def test_timed_launch_on_a_copy_stream_reports_the_work_duration(make_streams):
    # `Timing.seconds` promises to block until the timed work is done (it does on CUDA).
    streams = make_streams()
    _, timing = streams.d2h.launch(lambda: time.sleep(0.2), timed=True)
    assert timing is not None
    seconds = timing.seconds()  # no synchronize first: seconds() itself must wait
    assert seconds >= 0.2
    streams.synchronize()
    assert timing.seconds() == seconds


def test_timed_compute_launch_and_wait(make_streams):
    streams = make_streams()
    _, timing = streams.compute.launch(lambda: time.sleep(0.05), timed=True)
    assert timing.seconds() >= 0.05
    streams.d2h.launch(lambda: time.sleep(0.05))
    wait = streams.compute.wait_event(streams.d2h.record_event(), timed=True)
    assert wait is not None and wait.seconds() >= 0.0
    assert streams.compute.wait_event(streams.d2h.record_event()) is None


def test_public_names():
    assert chunk_offload.CpuStreams is CpuStreams
    assert issubclass(HappensBeforeError, ChunkOffloadError)
    assert issubclass(ChunkOffloadError, RuntimeError)
