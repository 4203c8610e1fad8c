"""`CudaStreams` on a fake ``torch.cuda`` (no GPU here): NOTE [CUDA event pool] and the CUDA side
of NOTE [Implied waits], the parts of the CUDA path that no CPU backend runs.

The fake records every event creation, record and stream wait, so the tests count the CUDA
calls the wrapper makes. `tests/gpu` runs the same code on a real device.
"""

from __future__ import annotations

import gc
import itertools

import pytest
import torch

from chunk_offload import OffloadConfig
from chunk_offload.core import Action, ActionKind
from chunk_offload.core.iteration_window import IterationWindow
from chunk_offload.core.stats import ResidentBytes, StatsRecorder
from chunk_offload.core.streams import CudaStreams
from chunk_offload.core.streams import cuda as cuda_module


class FakeEvent:
    made: list["FakeEvent"] = []
    clock_ms = 0.0  # the fake device's time: each record is `step_ms` after the one before
    step_ms = 2.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self.records: list[int] = []
        self.at_ms = 0.0
        FakeEvent.made.append(self)

    def record(self, stream: "FakeStream") -> None:
        self.records.append(stream.stream_id)
        FakeEvent.clock_ms += FakeEvent.step_ms
        self.at_ms = FakeEvent.clock_ms

    synchronized = 0  # host waits on any event

    def synchronize(self) -> None:
        FakeEvent.synchronized += 1

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.enable_timing and end.enable_timing, "elapsed_time needs timing events"
        return end.at_ms - self.at_ms  # milliseconds


class FakeStream:
    ids = itertools.count(100)
    waits: list[tuple[int, FakeEvent]] = []

    def __init__(self, device=None, *, stream_id: int | None = None, device_index: int = 0, device_type: int = 1) -> None:
        self.stream_id = next(FakeStream.ids) if stream_id is None else stream_id
        self.device_index = device_index
        self.device_type = device_type

    def wait_event(self, event: FakeEvent) -> None:
        FakeStream.waits.append((self.stream_id, event))


@pytest.fixture
def streams(monkeypatch):
    FakeEvent.made.clear()
    FakeStream.waits.clear()
    current = {"data": (1, 0, 1)}  # the current (compute) stream's triple
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(cuda_module, "current_stream_data", lambda index: current["data"])
    monkeypatch.setattr(cuda_module, "set_stream_data", lambda data: None)
    backend = CudaStreams("cuda:0")
    backend.current = current
    return backend


def test_a_freed_event_is_recorded_again_instead_of_made_anew(streams) -> None:
    first = streams.d2h.record_event()
    made = len(FakeEvent.made)
    cuda_event = first.cuda_event
    del first
    gc.collect()
    again = streams.d2h.record_event()
    assert again.cuda_event is cuda_event and len(FakeEvent.made) == made
    assert cuda_event.records == [streams.d2h._raw().stream_id] * 2
    held = streams.d2h.record_event()  # `again` is alive: a new one
    assert held.cuda_event is not cuda_event and len(FakeEvent.made) == made + 1


def test_a_timing_pair_returns_once_read(streams) -> None:
    _, timing = streams.d2h.launch(lambda: None, timed=True)
    made = len(FakeEvent.made)
    assert timing.seconds() == 0.002
    _, again = streams.h2d.launch(lambda: None, timed=True)  # another stream: its own pool
    _, third = streams.d2h.launch(lambda: None, timed=True)
    assert len(FakeEvent.made) == made + 2  # the h2d pair only; d2h reused its pair
    assert third.seconds() == again.seconds() == 0.002


def test_action_times_are_read_from_timing_events_on_compute(streams) -> None:
    """NOTE [Action times]: a time mark is a timing event recorded on the current stream; the
    seconds between two are the device's; a freed mark's event is recorded again."""
    start = streams.time_mark()
    FakeEvent.step_ms = 250.0  # the device reaches the next mark 250 ms later, whatever the host did
    try:
        later = streams.time_mark()
    finally:
        FakeEvent.step_ms = 2.0
    assert later.seconds_since(start) == 0.25
    assert start._event.records == later._event.records == [1]  # on compute (the current stream)
    event, made = later._event, len(FakeEvent.made)
    del later
    gc.collect()
    again = streams.time_mark()
    assert again._event is event and len(FakeEvent.made) == made
    streams.current["data"] = (2, 0, 1)
    assert streams.time_mark()._event.records == [2]


def test_waits_implied_by_a_later_wait_or_a_host_wait_are_not_issued(streams) -> None:
    first, second = streams.d2h.record_event(), streams.d2h.record_event()
    h2d = streams.h2d._raw().stream_id
    streams.h2d.wait_event(second)
    streams.h2d.wait_event(first)  # implied by the wait on `second`
    assert FakeStream.waits == [(h2d, second.cuda_event)]
    later = streams.d2h.record_event()
    later.synchronize()  # a host wait: implied for every stream
    streams.h2d.wait_event(later)
    streams.compute.wait_event(first)
    assert FakeStream.waits == [(h2d, second.cuda_event)]


def test_compute_forgets_its_waits_when_the_current_stream_changes(streams) -> None:
    reload = streams.h2d.record_event()
    streams.compute.wait_event(reload)
    streams.compute.wait_event(reload)  # implied: the same compute stream waited on it
    assert [sid for sid, _ in FakeStream.waits] == [1]
    streams.current["data"] = (2, 0, 1)  # another current stream: it has waited on nothing
    streams.compute.wait_event(reload)
    assert [sid for sid, _ in FakeStream.waits] == [1, 2]


def test_events_of_compute_are_always_waited_on(streams) -> None:
    """Compute is whatever stream is current: its events are untracked."""
    first, second = streams.compute.record_event(), streams.compute.record_event()
    streams.d2h.wait_event(second)
    streams.d2h.wait_event(first)
    assert [event for _, event in FakeStream.waits] == [second.cuda_event, first.cuda_event]


def test_capturing_asks_torch_about_the_current_stream(streams, monkeypatch) -> None:
    """NOTE [CUDA graph capture]: the engine's check is torch's own, on the current (compute) stream."""
    for answer in (False, True):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda answer=answer: answer)
        assert streams.capturing() is answer


def _records() -> int:
    return sum(len(event.records) for event in FakeEvent.made)


def test_a_timed_copy_records_one_event_as_its_end_and_its_event(streams) -> None:
    """NOTE [Timing end events]: two records per timed copy (start, and the end others wait on), not three."""
    before = _records()
    event, timing = streams.h2d.launch_recorded(lambda: None, timed=True)
    assert _records() - before == 2
    assert event.timing_end and timing._end is event.cuda_event
    assert timing.seconds() == 0.002  # the fake device: 2 ms between two records
    untimed, none = streams.h2d.launch_recorded(lambda: None)
    assert none is None and not untimed.timing_end and _records() - before == 3


def test_a_shared_end_event_returns_to_its_pool_only_once_freed_and_read(streams) -> None:
    event, timing = streams.d2h.launch_recorded(lambda: None, timed=True)
    end = event.cuda_event
    del event
    gc.collect()  # the wrapper is held by the timing: `end` is not handed out again
    _, other = streams.d2h.launch_recorded(lambda: None, timed=True)
    assert other._end is not end and other._start is not end
    assert timing.seconds() == 0.002
    gc.collect()  # read and freed: back to the timing pool, with the start event
    again, again_timing = streams.d2h.launch_recorded(lambda: None, timed=True)
    assert end in (again.cuda_event, again_timing._start)

    kept, timing = streams.d2h.launch_recorded(lambda: None, timed=True)
    assert timing.seconds() == 0.002  # read first: the wrapper still holds the event
    third, third_timing = streams.d2h.launch_recorded(lambda: None, timed=True)
    assert kept.cuda_event not in (third.cuda_event, third_timing._start)


def test_a_timed_wait_on_a_copy_event_ends_on_that_event(streams) -> None:
    """The stall is from compute reaching the wait to the reload's end, 0 where the reload ended first;
    one record on compute (the start), where a pair around the wait cost two."""
    reload, _ = streams.h2d.launch_recorded(lambda: None, timed=True)
    before = _records()
    stall = streams.compute.wait_event(reload, timed=True)
    assert _records() - before == 1 and FakeStream.waits[-1] == (1, reload.cuda_event)
    assert stall.seconds() == 0.0  # the fake device ended the reload (earlier record) before compute got there
    late, _ = streams.h2d.launch_recorded(lambda: None, timed=True)
    stall = streams.compute.wait_event(late, timed=True)
    late.cuda_event.at_ms = stall._start.at_ms + 7.0  # the device ends this reload 7 ms after compute waits
    assert stall.seconds() == 0.007
    plain = streams.h2d.record_event()  # not a timing event: a pair around the wait, as before
    before = _records()
    assert streams.compute.wait_event(plain, timed=True).seconds() == 0.002 and _records() - before == 2


def test_timings_read_after_the_device_synchronised_wait_on_no_event(streams) -> None:
    """NOTE [Reads after the device synchronised]: the same times, without a host wait per event."""
    _, copy = streams.d2h.launch_recorded(lambda: None, timed=True)
    reload, _ = streams.h2d.launch_recorded(lambda: None, timed=True)
    stall = streams.compute.wait_event(reload, timed=True)
    reload.cuda_event.at_ms = stall._start.at_ms + 3.0
    FakeEvent.synchronized = 0
    assert (copy.seconds(device_idle=True), stall.seconds(device_idle=True)) == (0.002, 0.003)
    assert FakeEvent.synchronized == 0
    _, again = streams.d2h.launch_recorded(lambda: None, timed=True)
    later = streams.compute.wait_event(streams.d2h.launch_recorded(lambda: None, timed=True)[0], timed=True)
    assert again.seconds() == 0.002 and later.seconds() == 0.0
    assert FakeEvent.synchronized == 3  # elsewhere: the copy's end; the wait's start and end


@pytest.mark.parametrize("measure_time", [True, False])
def test_an_iteration_end_reads_its_timings_after_one_device_sync(streams, monkeypatch, measure_time) -> None:
    """`IterationWindow.finish` synchronises the device (with ``measure_time``) and then reads every
    timing and action mark without an event wait; without it, the copy streams' waits only."""
    device_syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: device_syncs.append(device))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    stats = StatsRecorder()
    config = OffloadConfig(measure_time=measure_time)
    window = IterationWindow(streams, config, ResidentBytes(), stats, offload=True)
    window.note_action(Action(ActionKind.FORWARD, 0, 0))  # on the fake device: 2 ms after the start
    for name in ("a", "b"):
        _, copy = streams.d2h.launch_recorded(lambda: None, timed=True)
        stats.timing(name, "offload_time_s", copy)
        reload, _ = streams.h2d.launch_recorded(lambda: None, timed=True)
        stats.timing(name, "wait_time_s", streams.compute.wait_event(reload, timed=True))
    device_syncs.clear()
    FakeEvent.synchronized = 0
    record = window.finish()
    copy_stream_waits = 2  # `StreamBackend.synchronize`: one recorded event per copy stream
    if measure_time:
        assert len(device_syncs) == 1 and FakeEvent.synchronized == copy_stream_waits
        assert record.action_starts_s == [0.002]
    else:
        assert device_syncs == [] and FakeEvent.synchronized == copy_stream_waits + 2 * 3
    assert stats.groups["a"].offload_time_s == 0.002
