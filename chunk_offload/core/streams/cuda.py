"""`CudaStreams`: the stream interface on `torch.cuda` streams and events."""

from __future__ import annotations

import torch

from .._torch_compat import current_stream_data, set_stream_data
from .base import Event, Mark, Stream, StreamBackend, TimeMark, Timing, VectorClocks

__all__ = ["CudaStreams"]


# ----------------------------------------------------------------------------- CUDA


class _EventPool:
    """`torch.cuda.Event`s handed out again once nothing can use their last record.

    NOTE [CUDA event pool]
    Making an event costs a Python object, a ``cudaEventCreateWithFlags`` at its first record
    and a ``cudaEventDestroy`` when it is freed: two per group, and eight more with
    ``measure_time``. A synchronisation event comes back when its `_CudaEvent` is freed: no
    group, buffer or later wait can reach it, and the waits issued on it captured its record
    (``cudaStreamWaitEvent`` waits for the record made before it, whatever is recorded later).
    A timing pair comes back once its elapsed time was read (`Timing.seconds`); an end event that
    is also a synchronisation event once both its `_CudaEvent` is freed and its time was read
    (NOTE [Timing end events]).
    """

    __slots__ = ("_free", "timing")

    def __init__(self, enable_timing: bool) -> None:
        self._free: list[torch.cuda.Event] = []
        self.timing = enable_timing
        """Whether its events are made with ``enable_timing`` (they can end a `Timing`)."""

    def take(self) -> torch.cuda.Event:
        try:
            return self._free.pop()
        except IndexError:  # none free (a check first could race a free on another thread)
            return torch.cuda.Event(enable_timing=self.timing)

    def give(self, *events: torch.cuda.Event) -> None:
        self._free.extend(events)


class _CudaEvent(Event):
    __slots__ = ("cuda_event", "_pool")

    def __init__(self, clocks, mark, event: torch.cuda.Event, pool: _EventPool) -> None:
        super().__init__(clocks, mark)
        self.cuda_event = event
        self._pool = pool

    def __del__(self) -> None:
        self._pool.give(self.cuda_event)  # NOTE [CUDA event pool]

    @property
    def timing_end(self) -> bool:
        """Whether the event was made with ``enable_timing``: a `Timing` can end on it (NOTE [Timing end events])."""
        return self._pool.timing

    def synchronize(self) -> None:
        self.cuda_event.synchronize()
        self.host_waited()

    def query(self) -> bool:
        done = self.cuda_event.query()
        if done:
            self.host_waited()
        return done


class _CudaTimeMark(TimeMark):
    """A timing event recorded on the compute stream (NOTE [Action times]); back to its pool once freed."""

    __slots__ = ("_event", "_pool")

    def __init__(self, event: torch.cuda.Event, pool: _EventPool) -> None:
        super().__init__()
        self._event = event
        self._pool = pool

    def __del__(self) -> None:
        self._pool.give(self._event)  # NOTE [CUDA event pool]

    def seconds_since(self, earlier: TimeMark, *, device_idle: bool = False) -> float:
        if not device_idle:  # NOTE [Reads after the device synchronised] in core/stats.py
            earlier._event.synchronize()  # elapsed_time needs both done (they may sit on two streams)
            self._event.synchronize()
        return earlier._event.elapsed_time(self._event) / 1000.0


class _CudaStream(Stream):
    """A CUDA stream; ``stream=None`` means whatever stream is current when used (compute).

    NOTE [CUDA host path]
    Each call here runs per group, so it avoids torch.cuda's heavier Python helpers: the
    current stream is read as torch's ``(stream_id, device_index, device_type)`` triple and
    its Stream object is rebuilt only when that triple changes (`torch.cuda.current_stream`
    builds a new one at every call); work is issued between two stream switches by triple
    instead of the `torch.cuda.stream` context (which asks for the current stream of two
    devices on entry and exit); and `wait_stream` re-records one event per stream pair instead
    of making one per call. Re-recording is safe: a ``cudaStreamWaitEvent`` waits for the
    record made before it, whatever is recorded later.

    NOTE [Timing end events]
    With ``measure_time`` a copy's launch is timed by two timing events around it, and its
    synchronisation event (what later waits and buffer fences use) is recorded right after it,
    at the point the pair's end marks. `launch_recorded` records one timing event there and hands
    it out as both: the `Timing`'s end and the `_CudaEvent` others wait on. A compute wait on
    such an event is timed from one event recorded on compute before the wait to the waited event
    itself: compute stalls from reaching the wait until that event completes, so the time between
    them, or 0 where the event completed first, is the stall; the start may then complete last,
    so both are synchronised before the read. Per offloaded group with ``measure_time``: 7 event
    records instead of 10. The shared event is recorded once and given back to its pool only when
    nothing can read it: the `Timing` holds its `_CudaEvent` until the time is read, and the
    `_CudaEvent` gives it back once freed (NOTE [CUDA event pool]).
    """

    def __init__(self, name: str, clocks: VectorClocks, stream: torch.cuda.Stream | None, device_index: int) -> None:
        super().__init__(name, clocks)
        self._stream = stream
        self._index = device_index
        self._data = None if stream is None else (stream.stream_id, stream.device_index, stream.device_type)
        self._current: torch.cuda.Stream | None = None  # compute: the current stream last seen, and its triple
        self._current_data: tuple[int, int, int] | None = None
        self._wait_events: dict[int, torch.cuda.Event] = {}  # by the id of the stream waited on
        self._events = _EventPool(enable_timing=False)  # NOTE [CUDA event pool]
        self._timing_events = _EventPool(enable_timing=True)

    def _timing(self, raw: torch.cuda.Stream) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """A timing pair from the pool, its start recorded on ``raw`` now."""
        start, end = self._timing_events.take(), self._timing_events.take()
        start.record(raw)
        return start, end

    def _raw(self) -> torch.cuda.Stream:
        if self._stream is not None:
            return self._stream
        data = current_stream_data(self._index)
        if data != self._current_data:
            self._current = torch.cuda.Stream(stream_id=data[0], device_index=data[1], device_type=data[2])
            self._current_data = data
            self.after = {}  # another queue: it waited on nothing yet (NOTE [Implied waits])
        return self._current

    def _issue(self, fn) -> None:
        """Run ``fn`` with this stream current (`_raw` ran just before: NOTE [CUDA host path])."""
        previous = current_stream_data(self._index)
        set_stream_data(self._data if self._data is not None else self._current_data)
        try:
            fn()
        finally:
            set_stream_data(previous)

    def launch(self, fn, *, timed=False, nbytes=0):
        raw = self._raw()
        mark = self._vc.tick(self.id)
        start = end = None
        if timed:
            start, end = self._timing(raw)
        self._issue(fn)
        if timed:
            end.record(raw)
            return mark, Timing(start=start, end=end, recycle=self._timing_events.give)
        return mark, None

    def launch_recorded(self, fn, *, timed=False, nbytes=0):
        """`launch` and `record_event` with one event recorded after ``fn`` (NOTE [Timing end events])."""
        if not timed:
            self.launch(fn, nbytes=nbytes)
            return self.record_event(), None
        raw = self._raw()
        self._vc.tick(self.id)
        start, end = self._timing(raw)
        self._issue(fn)
        end.record(raw)
        event = self._event(end, self._timing_events)
        return event, Timing(start=start, end=end, recycle=self._timing_events.give, end_owner=event)

    def time_mark(self) -> TimeMark:
        """A timing event recorded on this stream now (NOTE [Action times])."""
        event = self._timing_events.take()
        event.record(self._raw())
        return _CudaTimeMark(event, self._timing_events)

    def record_event(self) -> Event:
        event = self._events.take()
        event.record(self._raw())
        return self._event(event, self._events)

    def _event(self, recorded: torch.cuda.Event, pool: _EventPool) -> _CudaEvent:
        """``recorded``, just recorded on this stream, as an `Event` that gives it back to ``pool`` once freed."""
        clocks = self._vc.snapshot(self.id)
        mark = Mark(self.id, clocks[self.id]) if clocks is not None else None
        return self.stamp(_CudaEvent(clocks, mark, recorded, pool), tracked=self._stream is not None)

    def wait_event(self, event, *, timed=False):
        raw = self._raw()  # first: it forgets the waits of a compute queue that changed
        if self.implies(event):
            self._vc.merge(self.id, event.clocks)
            return None
        self.waited(event)
        if timed and event.timing_end:  # NOTE [Timing end events]: the stall ends with ``event``
            start = self._timing_events.take()
            start.record(raw)
            raw.wait_event(event.cuda_event)
            self._vc.merge(self.id, event.clocks)
            return Timing(start=start, end=event.cuda_event, recycle=self._timing_events.give, end_owner=event, sync_start=True)
        start = end = None
        if timed:
            start, end = self._timing(raw)
        raw.wait_event(event.cuda_event)
        self._vc.merge(self.id, event.clocks)
        if timed:
            # Elapsed time between two events around the wait is the time the stream stalled.
            end.record(raw)
            return Timing(start=start, end=end, recycle=self._timing_events.give)
        return None

    def retain(self, tensors):
        # The caching allocator reuses the memory of a freed block used by another stream only
        # once an event it records on that stream at the free is done.
        raw = self._raw()
        for tensor in tensors:
            tensor.record_stream(raw)

    def wait_stream(self, other: Stream) -> None:
        event = self._wait_events.get(other.id)
        if event is None:
            event = self._wait_events[other.id] = torch.cuda.Event()
        event.record(other._raw())
        self._raw().wait_event(event)
        self._vc.merge_stream(self.id, other.id)
        if other._stream is not None:  # NOTE [Implied waits]: every event of ``other`` so far
            self.after[other.id] = other.recorded


class CudaStreams(StreamBackend):
    """Compute is the current CUDA stream at each call; two dedicated copy streams."""

    measures_link = True

    def __init__(self, device: torch.device | int | str | None = None, *, check_order: bool = False) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pin_memory = True
        self._clocks = VectorClocks(check_order)
        index = self.device.index
        self.compute = _CudaStream("compute", self._clocks, None, index)
        self.d2h = _CudaStream("d2h", self._clocks, torch.cuda.Stream(self.device), index)
        self.h2d = _CudaStream("h2d", self._clocks, torch.cuda.Stream(self.device), index)

    def time_mark(self) -> TimeMark:
        """A timing event recorded on the current (compute) stream now (NOTE [Action times])."""
        return self.compute.time_mark()

    def capturing(self) -> bool:
        """Whether the current (compute) stream is capturing a CUDA graph (NOTE [CUDA graph capture])."""
        return torch.cuda.is_current_stream_capturing()
