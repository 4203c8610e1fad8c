"""`CpuStreams` ordering: the worker-thread copy streams, events, vector-clock checks, failed work.

Every backend a test creates is closed by the `make_streams` fixture, which also checks that the
backend's two worker threads really ended.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from chunk_offload import ChunkOffloadError, HappensBeforeError
from tests.core._streams import JOIN_TIMEOUT_S


def test_work_launched_on_one_copy_stream_runs_in_issue_order(make_streams):
    streams = make_streams(max_delay_s=0.002, delay_on=("compute", "d2h", "h2d"), seed=7)
    done: list[int] = []
    for i in range(25):
        streams.d2h.launch(lambda i=i: done.append(i))
    streams.d2h.synchronize()
    assert done == list(range(25))


def test_copy_work_runs_on_the_named_worker_thread(make_streams):
    streams = make_streams()
    names: list[str] = []
    streams.d2h.launch(lambda: names.append(threading.current_thread().name))
    streams.h2d.launch(lambda: names.append(threading.current_thread().name))
    streams.synchronize()
    assert sorted(names) == ["chunk_offload-d2h", "chunk_offload-h2d"]


def test_event_recorded_after_work_completes_only_after_it(make_streams):
    streams = make_streams()
    gate = threading.Event()
    done: list[str] = []

    def blocked() -> None:
        assert gate.wait(JOIN_TIMEOUT_S)
        done.append("work")

    streams.d2h.launch(blocked)
    event = streams.d2h.record_event()
    time.sleep(0.05)
    assert not event.query(), "event completed before the work issued ahead of it"
    assert done == []
    gate.set()
    event.synchronize()
    assert event.query()
    assert done == ["work"]


def test_event_recorded_before_later_work_does_not_wait_for_it(make_streams):
    streams = make_streams()
    gate = threading.Event()
    streams.d2h.launch(lambda: None)
    early = streams.d2h.record_event()
    streams.d2h.launch(lambda: gate.wait(JOIN_TIMEOUT_S))
    early.synchronize()  # must not block on the gated work issued after the record
    assert early.query()
    gate.set()
    streams.d2h.synchronize()


def test_compute_wait_event_blocks_until_copy_work_is_done(make_streams):
    streams = make_streams()
    done: list[str] = []

    def slow() -> None:
        time.sleep(0.1)
        done.append("copy")

    streams.d2h.launch(slow)
    streams.compute.wait_event(streams.d2h.record_event())
    assert done == ["copy"]


def test_copy_stream_wait_event_orders_work_across_streams(make_streams):
    streams = make_streams()
    gate = threading.Event()
    order: list[str] = []

    def first() -> None:
        assert gate.wait(JOIN_TIMEOUT_S)
        order.append("d2h")

    streams.d2h.launch(first)
    streams.h2d.wait_event(streams.d2h.record_event())
    streams.h2d.launch(lambda: order.append("h2d"))
    h2d_done = streams.h2d.record_event()
    time.sleep(0.05)
    assert not h2d_done.query(), "h2d ran work before the d2h event it waits on"
    assert order == []
    gate.set()
    h2d_done.synchronize()
    assert order == ["d2h", "h2d"]


def test_compute_stream_runs_launched_work_at_once_and_its_events_are_done(make_streams):
    streams = make_streams()
    done: list[int] = []
    streams.compute.launch(lambda: done.append(1))
    assert done == [1]
    assert streams.compute.record_event().query()


def test_require_without_wait_raises_naming_the_rule(make_streams):
    streams = make_streams()
    saved = streams.compute.tick()
    with pytest.raises(HappensBeforeError, match=r"happens-before rule R1 violated") as info:
        streams.d2h.require(saved, rule="R1", what="offload reading a saved tensor")
    assert info.value.rule == "R1"
    message = str(info.value)
    assert "offload reading a saved tensor" in message
    assert "stream 'd2h'" in message and "stream 'compute'" in message
    assert f"its step {saved.step}" in message
    assert isinstance(info.value, ChunkOffloadError)


def test_require_fills_its_message_template_with_the_subject_only_on_failure(make_streams):
    streams = make_streams()
    saved = streams.compute.tick()
    with pytest.raises(HappensBeforeError, match=r"R1 violated: offload of 'core_attn' reading a saved tensor: stream 'd2h'"):
        streams.d2h.require(saved, rule="R1", what="offload of {!r} reading a saved tensor", subject="core_attn")
    streams.d2h.wait_stream(streams.compute)

    class NoFormat:  # formatting it would raise: a passing check must not build the message
        def __repr__(self) -> str:
            raise AssertionError("message built for a check that passed")

    streams.d2h.require(saved, rule="R1", what="offload of {!r}", subject=NoFormat())


def test_require_passes_after_wait_stream_and_fails_for_a_later_mark(make_streams):
    streams = make_streams()
    saved = streams.compute.tick()
    streams.d2h.wait_stream(streams.compute)
    streams.d2h.require(saved, rule="R1", what="offload")  # no error
    later = streams.compute.tick()
    with pytest.raises(HappensBeforeError, match="R1") as info:
        streams.d2h.require(later, rule="R1", what="offload")
    assert info.value.rule == "R1"
    streams.d2h.wait_stream(streams.compute)
    streams.d2h.require(later, rule="R1", what="offload")
    streams.synchronize()


def test_wait_on_an_event_recorded_before_the_mark_does_not_cover_it(make_streams):
    streams = make_streams()
    event = streams.compute.record_event()
    mark = streams.compute.tick()
    streams.d2h.wait_event(event)
    with pytest.raises(HappensBeforeError, match="R2") as info:
        streams.d2h.require(mark, rule="R2", what="x")
    assert info.value.rule == "R2"
    streams.synchronize()


def test_happens_before_is_transitive(make_streams):
    streams = make_streams()
    reload_mark, _ = streams.h2d.launch(lambda: None)
    assert reload_mark is not None
    streams.compute.wait_stream(streams.h2d)
    with pytest.raises(HappensBeforeError, match="R3"):
        streams.d2h.require(reload_mark, rule="R3", what="reuse")  # d2h has not waited on anything
    streams.d2h.wait_stream(streams.compute)
    streams.d2h.require(reload_mark, rule="R3", what="reuse")  # d2h -> compute -> h2d
    streams.synchronize()


def test_check_order_false_never_raises(make_streams):
    streams = make_streams(check_order=False)
    mark = streams.compute.tick()
    streams.d2h.require(mark, rule="R1", what="x")
    streams.h2d.require(streams.d2h.launch(lambda: None)[0], rule="R4", what="x")
    streams.synchronize()


def test_exception_in_launched_work_surfaces_on_synchronize(make_streams):
    streams = make_streams()
    ran: list[str] = []

    def boom() -> None:
        raise ValueError("copy exploded 1234")

    streams.d2h.launch(boom)
    streams.d2h.launch(lambda: ran.append("after"))
    with pytest.raises(ChunkOffloadError, match=r"a copy on a CPU copy stream failed: ValueError\('copy exploded 1234'\)") as info:
        streams.synchronize()
    assert isinstance(info.value.__cause__, ValueError)
    assert ran == [], "work issued after a failed copy must not run"
    # The failure stays visible to every later event of that stream ...
    with pytest.raises(ChunkOffloadError, match="copy exploded 1234"):
        streams.d2h.record_event().synchronize()
    # ... to compute waiting on it ...
    with pytest.raises(ChunkOffloadError, match="copy exploded 1234"):
        streams.compute.wait_event(streams.d2h.record_event())
    # ... and to a copy stream that waited on it.
    streams.h2d.wait_event(streams.d2h.record_event())
    with pytest.raises(ChunkOffloadError, match="copy exploded 1234"):
        streams.h2d.synchronize()


def test_a_copy_stream_waiting_on_a_failed_event_that_is_already_done_fails_too(make_streams):
    # A wait on a done event queues nothing for the worker unless the event carries an error:
    # this one is done (synchronized) and failed, so h2d must still take its error.
    streams = make_streams()

    def boom() -> None:
        raise ValueError("copy exploded 5678")

    streams.d2h.launch(boom)
    failed = streams.d2h.record_event()
    with pytest.raises(ChunkOffloadError, match="copy exploded 5678"):
        failed.synchronize()
    assert failed.query()
    ran: list[str] = []
    streams.h2d.wait_event(failed)
    streams.h2d.launch(lambda: ran.append("after"))
    with pytest.raises(ChunkOffloadError, match="copy exploded 5678"):
        streams.h2d.synchronize()
    assert ran == [], "work issued after a wait on a failed event must not run"


def test_a_copy_stream_waiting_on_a_done_event_runs_its_later_work(make_streams):
    streams = make_streams()
    streams.d2h.launch(lambda: None)
    done_event = streams.d2h.record_event()
    done_event.synchronize()
    ran: list[str] = []
    streams.h2d.wait_event(done_event)
    streams.h2d.launch(lambda: ran.append("after"))
    streams.h2d.synchronize()
    assert ran == ["after"]
    reload_mark = streams.d2h.tick()
    with pytest.raises(HappensBeforeError, match="R4"):  # the wait covers only what came before the event
        streams.h2d.require(reload_mark, rule="R4", what="x")
