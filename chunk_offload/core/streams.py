"""Copy streams and events behind one small interface, for CUDA and for CPU.

The engine only ever talks to a `StreamBackend`: a compute stream and two copy streams
(device-to-host and host-to-device), each able to launch work, record events and wait on
events. `CudaStreams` maps this onto `torch.cuda` streams. `CpuStreams` runs each copy
stream on a worker thread, so that a missing wait becomes a real race on CPU, optionally
widened by random delays, and checks every ordering rule with vector clocks.

NOTE [Happens-before rules]
Every stream keeps a vector clock: its own step counter plus the newest step of each other
stream it has waited on (through an event). Clocks advance when work is *issued*, as the
CUDA stream sanitizer does, so the check is deterministic whatever the threads do. The
engine states what each access depends on with `Stream.require(mark, rule=...)`:

- R1  a device-to-host copy may read a saved tensor only after its stream waited on compute
      at or after the moment the tensor was saved;
- R2  compute may use a reloaded tensor only after waiting on the reload's event, and may
      release an offloaded device tensor only after waiting on the offload's event;
- R3  a host buffer may be written by a new offload only after the reload that read it is
      known done (the writing stream waited on the reload's event);
- R4  a reload may write its device buffer only after its stream waited on compute where that
      buffer was allocated, and may read a host buffer only after the offload that filled it.

A violation raises `HappensBeforeError` at once, naming the rule. On a GPU the matching check
is PyTorch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``); `CudaStreams(check_order=True)`
also runs ours.
"""

from __future__ import annotations

import itertools
import queue
import random
import threading
import time
import weakref
from typing import Callable, NamedTuple

import torch

from .errors import ChunkOffloadError, HappensBeforeError

__all__ = [
    "Mark",
    "Event",
    "Timing",
    "Stream",
    "StreamBackend",
    "CudaStreams",
    "CpuStreams",
    "default_streams",
]


class Mark(NamedTuple):
    """One step of one stream: ``(stream id, step number)``."""

    stream: int
    step: int


class Timing:
    """Seconds spent by one launched copy or one compute wait, known once it is done."""

    __slots__ = ("_seconds", "_start", "_end", "_done")

    def __init__(self, seconds: float | None = None, start=None, end=None, done: threading.Event | None = None) -> None:
        self._seconds = seconds
        self._start = start
        self._end = end
        self._done = done  # CPU copy streams: set by the worker once the work ran (or was skipped)

    def seconds(self) -> float:
        """Block until the timed work is done and return its duration in seconds."""
        if self._done is not None:
            self._done.wait()
        if self._seconds is None and self._start is not None:
            self._end.synchronize()
            self._seconds = self._start.elapsed_time(self._end) / 1000.0
        return self._seconds or 0.0


class _VectorClocks:
    """Vector clocks of the streams of one backend; see NOTE [Happens-before rules]."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._clocks: dict[int, dict[int, int]] = {}
        self._names: dict[int, str] = {}

    def register(self, stream_id: int, name: str) -> None:
        self._clocks[stream_id] = {stream_id: 0}
        self._names[stream_id] = name

    def tick(self, stream_id: int) -> Mark | None:
        if not self.enabled:
            return None
        clock = self._clocks[stream_id]
        clock[stream_id] += 1
        return Mark(stream_id, clock[stream_id])

    def snapshot(self, stream_id: int) -> dict[int, int] | None:
        return dict(self._clocks[stream_id]) if self.enabled else None

    def merge(self, stream_id: int, other: dict[int, int] | None) -> None:
        if not self.enabled or other is None:
            return
        clock = self._clocks[stream_id]
        for sid, step in other.items():
            if step > clock.get(sid, 0):
                clock[sid] = step

    def require(self, stream_id: int, mark: Mark | None, rule: str, what: str) -> None:
        if not self.enabled or mark is None:
            return
        known = self._clocks[stream_id].get(mark.stream, 0)
        if known < mark.step:
            raise HappensBeforeError(
                rule,
                f"{what}: stream '{self._names[stream_id]}' has waited on stream "
                f"'{self._names[mark.stream]}' only up to step {known}, but the access depends on "
                f"its step {mark.step}. A wait (wait_event/wait_stream) is missing before this access.",
            )


class Event:
    """A point in one stream's work that other streams (or the host) can wait for."""

    def __init__(self, clocks: dict[int, int] | None, mark: Mark | None) -> None:
        self.clocks = clocks
        self.mark = mark

    def synchronize(self) -> None:
        """Block the host until the event's work is done."""
        raise NotImplementedError

    def query(self) -> bool:
        """Whether the event's work is done, without blocking."""
        raise NotImplementedError


class Stream:
    """One ordered queue of work. Subclasses say how work is issued."""

    _ids = itertools.count()

    def __init__(self, name: str, clocks: _VectorClocks) -> None:
        self.name = name
        self.id = next(Stream._ids)
        self._vc = clocks
        clocks.register(self.id, name)

    def launch(self, fn: Callable[[], None], *, timed: bool = False, nbytes: int = 0) -> tuple[Mark | None, Timing | None]:
        """Issue ``fn`` (which issues copies of ``nbytes`` bytes) in this stream's order; return its mark and timing."""
        raise NotImplementedError

    def record_event(self) -> Event:
        """An event that completes when all work issued to this stream so far is done."""
        raise NotImplementedError

    def wait_event(self, event: Event, *, timed: bool = False) -> Timing | None:
        """Make later work of this stream wait for ``event``."""
        raise NotImplementedError

    def wait_stream(self, other: "Stream") -> None:
        """Make later work of this stream wait for all work issued to ``other`` so far."""
        self.wait_event(other.record_event())

    def tick(self) -> Mark | None:
        """A named moment of this stream (a tensor saved or allocated now), for `require`."""
        return self._vc.tick(self.id)

    def require(self, mark: Mark | None, *, rule: str, what: str) -> None:
        """Raise `HappensBeforeError` unless this stream is known to come after ``mark``."""
        self._vc.require(self.id, mark, rule, what)

    def synchronize(self) -> None:
        """Block the host until all work issued to this stream is done."""
        self.record_event().synchronize()


class StreamBackend:
    """The three streams the engine uses, plus what it needs to know about the device."""

    device: torch.device
    pin_memory: bool
    compute: Stream
    d2h: Stream
    h2d: Stream

    def synchronize(self) -> None:
        """Block until both copy streams are idle."""
        self.d2h.synchronize()
        self.h2d.synchronize()

    def close(self) -> None:
        """Release threads or other resources; the backend is unusable afterwards."""


# ----------------------------------------------------------------------------- CUDA


class _CudaEvent(Event):
    def __init__(self, clocks, mark, event: torch.cuda.Event) -> None:
        super().__init__(clocks, mark)
        self.cuda_event = event

    def synchronize(self) -> None:
        self.cuda_event.synchronize()

    def query(self) -> bool:
        return self.cuda_event.query()


class _CudaStream(Stream):
    """A CUDA stream; ``stream=None`` means whatever stream is current when used (compute)."""

    def __init__(self, name: str, clocks: _VectorClocks, stream: torch.cuda.Stream | None) -> None:
        super().__init__(name, clocks)
        self._stream = stream

    def _raw(self) -> torch.cuda.Stream:
        return self._stream if self._stream is not None else torch.cuda.current_stream()

    def launch(self, fn, *, timed=False, nbytes=0):
        raw = self._raw()
        mark = self._vc.tick(self.id)
        start = end = None
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(raw)
        with torch.cuda.stream(raw):
            fn()
        if timed:
            end.record(raw)
            return mark, Timing(start=start, end=end)
        return mark, None

    def record_event(self) -> Event:
        event = torch.cuda.Event()
        event.record(self._raw())
        clocks = self._vc.snapshot(self.id)
        mark = Mark(self.id, clocks[self.id]) if clocks is not None else None
        return _CudaEvent(clocks, mark, event)

    def wait_event(self, event, *, timed=False):
        raw = self._raw()
        start = end = None
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(raw)
        raw.wait_event(event.cuda_event)
        self._vc.merge(self.id, event.clocks)
        if timed:
            # Elapsed time between two events around the wait is the time the stream stalled.
            end.record(raw)
            return Timing(start=start, end=end)
        return None


class CudaStreams(StreamBackend):
    """Compute is the current CUDA stream at each call; two dedicated copy streams."""

    def __init__(self, device: torch.device | int | str | None = None, *, check_order: bool = False) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self.pin_memory = True
        self._clocks = _VectorClocks(check_order)
        self.compute = _CudaStream("compute", self._clocks, None)
        self.d2h = _CudaStream("d2h", self._clocks, torch.cuda.Stream(self.device))
        self.h2d = _CudaStream("h2d", self._clocks, torch.cuda.Stream(self.device))


# ----------------------------------------------------------------------------- CPU


class _CpuEvent(Event):
    def __init__(self, clocks, mark, done: bool = False) -> None:
        super().__init__(clocks, mark)
        self._done = threading.Event()
        self.error: BaseException | None = None
        if done:
            self._done.set()

    def set(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise ChunkOffloadError(f"a copy on a CPU copy stream failed: {self.error!r}") from self.error

    def query(self) -> bool:
        return self._done.is_set()


class _Delay:
    """Random sleeps that widen the windows in which a missing wait shows up as wrong data."""

    def __init__(self, max_seconds: float, seed: int) -> None:
        self.max_seconds = max_seconds
        self._rng = random.Random(seed)

    def __call__(self) -> None:
        if self.max_seconds > 0:
            time.sleep(self._rng.uniform(0.0, self.max_seconds))


class _CpuComputeStream(Stream):
    """The host thread itself: work runs at once, waits block the host."""

    def __init__(self, name, clocks, delay: _Delay) -> None:
        super().__init__(name, clocks)
        self._delay = delay

    def launch(self, fn, *, timed=False, nbytes=0):
        self._delay()
        mark = self._vc.tick(self.id)
        start = time.perf_counter()
        fn()
        return mark, Timing(time.perf_counter() - start) if timed else None

    def tick(self):
        self._delay()
        return super().tick()

    def record_event(self) -> Event:
        clocks = self._vc.snapshot(self.id)
        mark = Mark(self.id, clocks[self.id]) if clocks is not None else None
        return _CpuEvent(clocks, mark, done=True)

    def wait_event(self, event, *, timed=False):
        start = time.perf_counter()
        event.synchronize()
        self._vc.merge(self.id, event.clocks)
        self._delay()
        return Timing(time.perf_counter() - start) if timed else None


class _CpuCopyStream(Stream):
    """A worker thread executing launched work, event records and waits in issue order."""

    def __init__(self, name, clocks, delay: _Delay, link_bytes_per_s: float | None = None) -> None:
        super().__init__(name, clocks)
        self._delay = delay
        self._link_bytes_per_s = link_bytes_per_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"chunk_offload-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            op, arg, timing, nbytes = self._queue.get()
            if op == "stop":
                return
            if op == "wait":
                arg._done.wait()
                if arg.error is not None and self._error is None:
                    self._error = arg.error
            elif op == "record":
                arg.set(self._error)
            else:
                if self._error is None:
                    self._delay()
                    start = time.perf_counter()
                    try:
                        arg()
                        if self._link_bytes_per_s:
                            time.sleep(nbytes / self._link_bytes_per_s)  # the simulated link's transfer time
                    except BaseException as exc:  # surfaced to the host by the next event
                        self._error = exc
                    if timing is not None:
                        timing._seconds = time.perf_counter() - start
                if timing is not None:
                    timing._done.set()

    def launch(self, fn, *, timed=False, nbytes=0):
        self._check_running()
        mark = self._vc.tick(self.id)
        timing = Timing(0.0, done=threading.Event()) if timed else None
        self._queue.put(("run", fn, timing, nbytes))
        return mark, timing

    def record_event(self) -> Event:
        self._check_running()
        clocks = self._vc.snapshot(self.id)
        mark = Mark(self.id, clocks[self.id]) if clocks is not None else None
        event = _CpuEvent(clocks, mark)
        self._queue.put(("record", event, None, 0))
        return event

    def wait_event(self, event, *, timed=False):
        self._vc.merge(self.id, event.clocks)
        self._queue.put(("wait", event, None, 0))
        return None

    def _check_running(self) -> None:
        # An event recorded on a stopped worker would never complete: waiting on it would hang.
        if self._stopped:
            raise ChunkOffloadError(f"CPU copy stream '{self.name}' used after its backend was closed.")

    def stop(self) -> None:
        self._stopped = True
        self._queue.put(("stop", None, None, 0))


class CpuStreams(StreamBackend):
    """Copy streams as worker threads, with happens-before checks and optional random delays.

    Args:
        max_delay_s: upper bound of the random sleep before each operation on the streams
            named in ``delay_on``; 0 disables delays.
        delay_on: which of ``"d2h"``, ``"h2d"``, ``"compute"`` get delays.
        seed: seeds the delays, so a failing interleaving can be replayed.
        check_order: check the rules of NOTE [Happens-before rules].
        link_bytes_per_s: simulate a host link of this bandwidth: each copy also takes
            ``bytes / link_bytes_per_s`` seconds on its stream (None: copies take what memcpy takes).
    """

    _STREAM_NAMES = ("compute", "d2h", "h2d")

    def __init__(
        self,
        *,
        max_delay_s: float = 0.0,
        delay_on: tuple[str, ...] = ("d2h", "h2d"),
        seed: int = 0,
        check_order: bool = True,
        link_bytes_per_s: float | None = None,
    ) -> None:
        unknown = sorted(set(delay_on) - set(self._STREAM_NAMES))
        if unknown:
            raise ChunkOffloadError(f"delay_on names unknown streams {unknown}; valid: {list(self._STREAM_NAMES)}")
        if max_delay_s < 0:
            raise ChunkOffloadError(f"max_delay_s must be >= 0, got {max_delay_s}")
        if link_bytes_per_s is not None and not link_bytes_per_s > 0:
            raise ChunkOffloadError(f"link_bytes_per_s must be > 0 or None, got {link_bytes_per_s}")
        self.device = torch.device("cpu")
        self.pin_memory = False
        self._clocks = _VectorClocks(check_order)

        def delay(name: str, offset: int) -> _Delay:
            return _Delay(max_delay_s if name in delay_on else 0.0, seed * 3 + offset)

        self.compute = _CpuComputeStream("compute", self._clocks, delay("compute", 0))
        self.d2h = _CpuCopyStream("d2h", self._clocks, delay("d2h", 1), link_bytes_per_s)
        self.h2d = _CpuCopyStream("h2d", self._clocks, delay("h2d", 2), link_bytes_per_s)
        self._finalizer = weakref.finalize(self, _stop_workers, self.d2h, self.h2d)

    def close(self) -> None:
        self._finalizer()


def _stop_workers(*streams: _CpuCopyStream) -> None:
    for stream in streams:
        stream.stop()


def default_streams(device: torch.device | int | str | None = None) -> StreamBackend:
    """CUDA streams when CUDA is available (or ``device`` is a CUDA device), CPU streams otherwise."""
    if device is not None and torch.device(device).type == "cpu":
        return CpuStreams()
    if torch.cuda.is_available():
        return CudaStreams(device)
    return CpuStreams()
