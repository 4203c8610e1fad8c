"""The stream interface (`StreamBackend`, `Stream`, `Event`) and the happens-before checker.

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
      release an offloaded device tensor only after waiting on the offload's event or after
      handing it to the copy stream (`Stream.retain`: NOTE [Release by the copy stream]);
- R3  a host buffer may be written by a new offload only after the reload that read it is
      known done (the writing stream waited on the reload's event);
- R4  a reload may write its device buffer only after its stream waited on compute where that
      buffer was allocated, and may read a host buffer only after the offload that filled it.

A violation raises `HappensBeforeError` at once, naming the rule. On a GPU the matching check
is PyTorch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``); `CudaStreams(check_order=True)`
also runs ours.

NOTE [Implied waits]
A wait on an event is not issued when the waiting stream is already after it: the host waited
for that event or a later one of its stream (`Event.synchronize`, a stream's synchronize: what
the host waited for is done, so any work issued afterwards follows it), or this stream waited
on a later event of the same stream (or on the whole stream, `wait_stream`). Events of one
stream are numbered in record order (`Stream.stamp`) and each stream keeps the newest number
it waited on per stream, so the test is two integer comparisons. The clocks are merged all the
same (the checker sees the order the skipped wait would have made). In steady state this drops
the buffer fences of a forward (the manager's iteration end waits for both copy streams) and
every reload's wait on its offload but the first of a backward (backward reloads groups in the
reverse of their offload order). A stream whose queue may change between two records (CUDA's
compute, the current stream) stamps its events untracked: they are always waited on, and its
own numbers restart when its queue changes. PyTorch's CUDA sanitizer orders host waits the
same way (an event synchronize makes every stream wait for the event).
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, NamedTuple

import torch

from ..errors import HappensBeforeError

__all__ = ["Event", "Mark", "Stream", "StreamBackend", "TimeMark", "Timing", "VectorClocks"]


class Mark(NamedTuple):
    """One step of one stream: ``(stream id, step number)``."""

    stream: int
    step: int


class Timing:
    """Seconds spent by one launched copy or one compute wait, known once it is done."""

    __slots__ = ("_seconds", "_start", "_end", "_done", "_recycle", "_end_owner", "_sync_start")

    def __init__(
        self, seconds: float | None = None, start=None, end=None, done=None, recycle=None, end_owner: "Event | None" = None, sync_start: bool = False
    ) -> None:
        self._seconds = seconds
        self._start = start
        self._end = end
        self._done = done  # CPU copy streams: a flag (``set``/``wait``) the worker sets once the work ran (or was skipped)
        self._recycle = recycle  # takes the start and end events back once their elapsed time is read
        self._end_owner = end_owner
        """The `Event` recorded as ``end`` itself (NOTE [Timing end events] in streams/cuda.py): held
        until the time is read, so that ``end`` is not recorded again before; it gives ``end`` back."""
        self._sync_start = sync_start  # ``start`` is on another stream than ``end``: it may end last

    def seconds(self, *, device_idle: bool = False) -> float:
        """Block until the timed work is done and return its duration in seconds (a wait that
        did not stall: 0). ``device_idle``: the caller synchronised the whole device since the
        work was issued, so its events are done and need no host wait (NOTE [Reads after the
        device synchronised])."""
        if self._done is not None:
            self._done.wait()
        if self._seconds is None and self._start is not None:
            if not device_idle:
                if self._sync_start:
                    self._start.synchronize()
                self._end.synchronize()
            self._seconds = max(0.0, self._start.elapsed_time(self._end) / 1000.0)
            if self._recycle is not None:
                if self._end_owner is None:
                    self._recycle(self._start, self._end)
                else:
                    self._recycle(self._start)
            self._start = self._end = self._end_owner = None
        return self._seconds or 0.0


class TimeMark:
    """A moment on the compute stream's timeline (`StreamBackend.time_mark`).

    NOTE [Action times]
    The iteration record's action starts (`IterationRecord.action_starts_s`), which a
    `chunk_offload.schedule.CopyTiming` compares with copy durations, are read where compute
    runs. On CPU that is the host's clock. On CUDA, with ``measure_time``, each is a timing event
    recorded on the compute stream, read at the iteration's end after the device synchronised:
    the host runs ahead of the device by up to a queue of kernels and does not see the device
    wait in a pipeline's bubbles, so host times would shorten or shift the windows the copies
    hide in, while the copy durations are device times (events on their streams). Without
    ``measure_time`` the host's clock: no event, no sync, and no copy times either.
    """

    __slots__ = ("_seconds",)

    def __init__(self, seconds: float = 0.0) -> None:
        self._seconds = seconds

    def seconds_since(self, earlier: "TimeMark", *, device_idle: bool = False) -> float:
        """Seconds from ``earlier`` to this moment (for a device mark: once compute reached it;
        ``device_idle`` as `Timing.seconds` takes it)."""
        return self._seconds - earlier._seconds


def host_time_mark() -> TimeMark:
    """Now on the host's clock (NOTE [Action times])."""
    return TimeMark(time.perf_counter())


class VectorClocks:
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

    def merge_stream(self, stream_id: int, other_id: int) -> None:
        """`merge` with the current clock of stream ``other_id`` (a wait on all its work issued so far)."""
        if self.enabled:
            self.merge(stream_id, self._clocks[other_id])

    def require(self, stream_id: int, mark: Mark | None, rule: str, what: str, subject: object = None) -> None:
        if not self.enabled or mark is None:
            return
        known = self._clocks[stream_id].get(mark.stream, 0)
        if known < mark.step:
            if subject is not None:
                what = what.format(subject)
            raise HappensBeforeError(
                rule,
                f"{what}: stream '{self._names[stream_id]}' has waited on stream "
                f"'{self._names[mark.stream]}' only up to step {known}, but the access depends on "
                f"its step {mark.step}. A wait (wait_event/wait_stream) is missing before this access.",
            )


class Event:
    """A point in one stream's work that other streams (or the host) can wait for."""

    __slots__ = ("clocks", "mark", "source", "seq")

    def __init__(self, clocks: dict[int, int] | None, mark: Mark | None) -> None:
        self.clocks = clocks
        self.mark = mark
        self.source: Stream | None = None  # set by `Stream.stamp` when waits on it may be implied
        self.seq = 0

    def synchronize(self) -> None:
        """Block the host until the event's work is done."""
        raise NotImplementedError

    def host_waited(self) -> None:
        """The host saw this event done: later waits on it or earlier events of its stream are
        implied (NOTE [Implied waits]). Called by `synchronize` and a true `query`."""
        source = self.source
        if source is not None and self.seq > source.done_through:
            source.done_through = self.seq

    def query(self) -> bool:
        """Whether the event's work is done, without blocking."""
        raise NotImplementedError


class Stream:
    """One ordered queue of work. Subclasses say how work is issued."""

    _ids = itertools.count()

    def __init__(self, name: str, clocks: VectorClocks) -> None:
        self.name = name
        self.id = next(Stream._ids)
        self._vc = clocks
        clocks.register(self.id, name)
        self.recorded = 0  # events stamped on this stream so far (NOTE [Implied waits])
        self.done_through = 0  # of those, the newest the host saw done
        self.after: dict[int, int] = {}  # stream id -> the newest of its events this stream waited on

    def stamp(self, event: Event, tracked: bool = True) -> Event:
        """Number ``event``, just recorded on this stream; ``tracked=False``: waits on it are
        never implied (a stream whose queue may change, NOTE [Implied waits])."""
        self.recorded += 1
        event.source = self if tracked else None
        event.seq = self.recorded
        return event

    def implies(self, event: Event) -> bool:
        """Whether this stream is already after ``event`` (NOTE [Implied waits]): a wait on it
        would order nothing. A backend's `wait_event` then only merges the clocks."""
        source = event.source
        if source is None:
            return False
        seq = event.seq
        return seq <= source.done_through or seq <= self.after.get(source.id, 0)

    def waited(self, event: Event) -> None:
        """Note a wait on ``event`` issued to this stream (NOTE [Implied waits])."""
        source = event.source
        if source is not None and event.seq > self.after.get(source.id, 0):
            self.after[source.id] = event.seq

    def launch(self, fn: Callable[[], None], *, timed: bool = False, nbytes: int = 0) -> tuple[Mark | None, Timing | None]:
        """Issue ``fn`` (which issues copies of ``nbytes`` bytes) in this stream's order; return its mark and timing."""
        raise NotImplementedError

    def record_event(self) -> Event:
        """An event that completes when all work issued to this stream so far is done."""
        raise NotImplementedError

    def launch_recorded(self, fn: Callable[[], None], *, timed: bool = False, nbytes: int = 0) -> tuple[Event, Timing | None]:
        """`launch`, then `record_event`: the event of ``fn``'s work, and its timing. A backend
        may record one event as both (NOTE [Timing end events] in streams/cuda.py)."""
        _, timing = self.launch(fn, timed=timed, nbytes=nbytes)
        return self.record_event(), timing

    def wait_event(self, event: Event, *, timed: bool = False) -> Timing | None:
        """Make later work of this stream wait for ``event``."""
        raise NotImplementedError

    def wait_stream(self, other: "Stream") -> None:
        """Make later work of this stream wait for all work issued to ``other`` so far."""
        self.wait_event(other.record_event())

    def retain(self, tensors: list[torch.Tensor]) -> None:
        """Keep the memory of ``tensors`` from reuse until the work issued to this stream so far
        is done, whoever frees them and when, without making any stream or the host wait
        (NOTE [Release by the copy stream] in copies.py)."""
        raise NotImplementedError

    def tick(self) -> Mark | None:
        """A named moment of this stream (a tensor saved or allocated now), for `require`."""
        return self._vc.tick(self.id)

    def require(self, mark: Mark | None, *, rule: str, what: str, subject: object = None) -> None:
        """Raise `HappensBeforeError` unless this stream is known to come after ``mark``.

        ``what`` names the access; with ``subject`` it is a `str.format` template filled with
        it, so that the message costs nothing unless the check fails (it runs per saved tensor).
        """
        if mark is not None:  # None: the checker is off
            self._vc.require(self.id, mark, rule, what, subject)

    def synchronize(self) -> None:
        """Block the host until all work issued to this stream is done."""
        self.record_event().synchronize()


class StreamBackend:
    """The three streams the engine uses, plus what it needs to know about the device."""

    device: torch.device
    pin_memory: bool
    copies_hold_sources = False
    """Whether a copy in flight holds references to the tensors it reads (CPU worker threads),
    so that a check of what else holds a storage must wait for the copies first."""
    measures_link = False
    """Whether copy times measure the device's link (CUDA copy engines), rather than the host's
    scheduling of worker threads: ``timed_reload_ahead="auto"`` plans reloads by them only then."""
    compute: Stream
    d2h: Stream
    h2d: Stream

    def synchronize(self) -> None:
        """Block until both copy streams are idle."""
        self.d2h.synchronize()
        self.h2d.synchronize()

    def time_mark(self) -> TimeMark:
        """Now on the compute stream's timeline (NOTE [Action times]): the host's clock, where
        compute runs on the host."""
        return host_time_mark()

    def capturing(self) -> bool:
        """Whether the compute stream is capturing a CUDA graph now (False where there are none).

        NOTE [CUDA graph capture]
        A CUDA graph replays the kernels and copies issued while it was captured without running
        any Python: no module hook, saved-tensor hook or group bookkeeping runs on a replay. A group
        inside a captured region would copy into host buffers the pool hands to other groups between
        replays, and nothing would reload it. So no group opens while compute is capturing:
        `ChunkOffloadHandler.open_group` raises, naming the group and the way out, before it pushes a
        hook or issues a copy. Megatron's integration refuses earlier, at attach, a model configured
        to capture whole layers (`integrations.megatron.modules.check_model_support`).
        """
        return False

    def close(self) -> None:
        """Release threads or other resources; the backend is unusable afterwards."""


