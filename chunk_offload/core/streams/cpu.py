"""`CpuStreams`: the stream interface simulated on CPU, copy streams on worker threads.

A missing wait becomes a real race on CPU (optionally widened by random delays), and the
vector clocks of `base.VectorClocks` check every ordering rule (NOTE [Happens-before rules]).
"""

from __future__ import annotations

import math

import queue
import random
import threading
import time
import weakref

import torch

from ..errors import ChunkOffloadError
from .base import Event, Mark, Stream, StreamBackend, Timing, VectorClocks

__all__ = ["CpuStreams"]


# ----------------------------------------------------------------------------- CPU


class _Flag:
    """A one-shot "done" flag that one thread sets once and any thread waits for.

    A held lock that `set` releases: one object per event or timed copy, where a
    `threading.Event` builds four (itself, a condition, its lock and a deque) for each.
    """

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        self._lock.release()

    def is_set(self) -> bool:
        return not self._lock.locked()

    def wait(self) -> None:
        with self._lock:  # acquirable only once set; released at once for the next waiter
            pass


class _CpuEvent(Event):
    __slots__ = ("_done", "error")

    def __init__(self, clocks, mark, done: bool = False) -> None:
        self.clocks = clocks  # `Event.__init__`, without the call (several events per group)
        self.mark = mark
        self.source = None
        self.seq = 0
        # None: done when made (the compute stream's events, several per group): no flag.
        self._done: _Flag | None = None if done else _Flag()
        self.error: BaseException | None = None

    def set(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()

    def wait_done(self) -> None:
        """Block until the event's work ran (without raising its error)."""
        if self._done is not None:
            self._done.wait()

    def synchronize(self) -> None:
        self.wait_done()
        if self.error is not None:
            raise ChunkOffloadError(f"a copy on a CPU copy stream failed: {self.error!r}") from self.error
        self.host_waited()

    def query(self) -> bool:
        return self._done is None or self._done.is_set()


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
        if self._delay.max_seconds > 0:  # runs per saved tensor: no call when delays are off
            self._delay()
        return self._vc.tick(self.id)

    def record_event(self) -> Event:
        clocks = self._vc.snapshot(self.id)
        mark = Mark(self.id, clocks[self.id]) if clocks is not None else None
        return self.stamp(_CpuEvent(clocks, mark, done=True))

    def wait_event(self, event, *, timed=False):
        if not timed and self._delay.max_seconds == 0:  # twice per group: no clock reads, no delay call
            event.synchronize()  # the host waits: NOTE [Implied waits] for every stream after it
            self._vc.merge(self.id, event.clocks)
            return None
        start = time.perf_counter()
        event.synchronize()
        self._vc.merge(self.id, event.clocks)
        self._delay()
        return Timing(time.perf_counter() - start) if timed else None


# The operations a copy stream's worker executes, in issue order (one tuple each:
# ``(op, argument, timing, nbytes)``).
_RUN, _RECORD, _WAIT, _STOP = range(4)


class _CpuCopyStream(Stream):
    """A worker thread executing launched work, event records and waits in issue order.

    NOTE [Batched issue]
    Launches and waits are handed to the worker in one batch with the next event record (or
    at once for timed work, whose timing the host may wait on): every hand-over wakes the
    worker, which costs more than the copy of a small tensor. Nothing waits on unrecorded work:
    the host and the other streams wait on events only, and recording one sends the batch.
    A wait on an event that is already done without an error (every compute event, and a
    reused buffer's fence whose reload ran) only merges clocks: the worker would have nothing
    to wait for, so no operation is queued for it.
    """

    def __init__(self, name, clocks, delay: _Delay, link_bytes_per_s: float | None = None) -> None:
        super().__init__(name, clocks)
        self._delay = delay
        self._link_bytes_per_s = link_bytes_per_s
        # Neither delays nor a simulated link: an untimed launch is just its call on the worker.
        self._plain = delay.max_seconds == 0 and not link_bytes_per_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._stopped = False
        self._batch: list[tuple] = []  # operations not handed to the worker yet (NOTE [Batched issue])
        # The last event recorded: `synchronize` with nothing issued since waits on it instead of
        # a round trip to the worker.
        self._last_event: _CpuEvent | None = None
        self._thread = threading.Thread(target=self._run, name=f"chunk_offload-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        get = self._queue.get
        while self._run_batch(get()):
            pass

    def _run_batch(self, batch: list[tuple]) -> bool:
        """Run one batch of operations on the worker thread, in order; False once told to stop."""
        plain = self._plain
        # Popped, not iterated: once an event of the batch is set, the worker holds nothing of
        # the work before it (a copy's source must be freeable: NOTE [Storages held elsewhere]).
        batch.reverse()
        pop = batch.pop
        while batch:
            op, arg, timing, nbytes = pop()
            if op == _RUN:
                if timing is None and plain:
                    if self._error is None:
                        try:
                            arg()
                        except BaseException as exc:  # surfaced to the host by the next event
                            self._error = exc
                else:
                    self._run_one(arg, timing, nbytes)
            elif op == _RECORD:
                arg.set(self._error)
            elif op == _WAIT:
                arg.wait_done()
                if arg.error is not None and self._error is None:
                    self._error = arg.error
            else:
                return False
        return True

    def _run_one(self, fn, timing: Timing | None, nbytes: int) -> None:
        """Run one launched work item with its delay, simulated link time and timing."""
        if self._error is None:
            self._delay()
            start = time.perf_counter()
            try:
                fn()
                if self._link_bytes_per_s:
                    time.sleep(nbytes / self._link_bytes_per_s)  # the simulated link's transfer time
            except BaseException as exc:  # surfaced to the host by the next event
                self._error = exc
            if timing is not None:
                timing._seconds = time.perf_counter() - start
        if timing is not None:
            timing._done.set()

    def launch(self, fn, *, timed=False, nbytes=0):
        if self._stopped:
            self._raise_stopped()
        mark = self._vc.tick(self.id)
        if timed:
            timing = Timing(0.0, done=_Flag())
            self._batch.append((_RUN, fn, timing, nbytes))
            self._flush()
            return mark, timing
        self._batch.append((_RUN, fn, None, nbytes))
        return mark, None

    def record_event(self) -> Event:
        if self._stopped:
            self._raise_stopped()
        clocks = self._vc.snapshot(self.id)
        event = self.stamp(_CpuEvent(clocks, None if clocks is None else Mark(self.id, clocks[self.id])))
        self._last_event = event
        batch, self._batch = self._batch, []
        batch.append((_RECORD, event, None, 0))
        self._queue.put(batch)
        return event

    def wait_event(self, event, *, timed=False):
        self._vc.merge(self.id, event.clocks)
        if self.implies(event) or event._done is None or (event._done.is_set() and event.error is None):
            return None  # implied, or done without an error: nothing for the worker to wait for (NOTE [Batched issue])
        self._batch.append((_WAIT, event, None, 0))
        self.waited(event)
        return None

    def retain(self, tensors):
        # Nothing to do: the work launched here holds references to the tensors it reads until
        # it ran, and CPU memory is reused only once nothing references it.
        return None

    def wait_stream(self, other: Stream) -> None:
        if isinstance(other, _CpuComputeStream):
            # Work on the host thread is done when issued: only the clocks move (no event object).
            self._vc.merge_stream(self.id, other.id)
            return
        super().wait_stream(other)

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        self._queue.put(batch)

    def synchronize(self) -> None:
        if self._batch or self._last_event is None:
            super().synchronize()
            return
        if self._stopped:
            self._raise_stopped()
        self._last_event.synchronize()  # the worker has nothing after it (and raises its error, if any)

    def _raise_stopped(self) -> None:
        # An event recorded on a stopped worker would never complete: waiting on it would hang.
        raise ChunkOffloadError(f"CPU copy stream '{self.name}' used after its backend was closed.")

    def stop(self) -> None:
        self._stopped = True
        self._batch.append((_STOP, None, None, 0))
        self._flush()


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
        reload_link_bytes_per_s: the host-to-device rate where the link differs by direction
            (None: ``link_bytes_per_s`` both ways).
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
        reload_link_bytes_per_s: float | None = None,
    ) -> None:
        unknown = sorted(set(delay_on) - set(self._STREAM_NAMES))
        if unknown:
            raise ChunkOffloadError(f"delay_on names unknown streams {unknown}; valid: {list(self._STREAM_NAMES)}")
        if isinstance(max_delay_s, bool) or not isinstance(max_delay_s, (int, float)) or not 0 <= max_delay_s < math.inf:
            raise ChunkOffloadError(f"CpuStreams(max_delay_s=...) takes a finite number of seconds >= 0, got {max_delay_s!r}")
        for label, rate in (("link_bytes_per_s", link_bytes_per_s), ("reload_link_bytes_per_s", reload_link_bytes_per_s)):
            if rate is not None and not rate > 0:
                raise ChunkOffloadError(f"{label} must be > 0 or None, got {rate}")
        reload_rate = link_bytes_per_s if reload_link_bytes_per_s is None else reload_link_bytes_per_s
        self.device = torch.device("cpu")
        self.pin_memory = False
        self.copies_hold_sources = True
        self._clocks = VectorClocks(check_order)

        def delay(name: str, offset: int) -> _Delay:
            return _Delay(max_delay_s if name in delay_on else 0.0, seed * 3 + offset)

        self.compute = _CpuComputeStream("compute", self._clocks, delay("compute", 0))
        self.d2h = _CpuCopyStream("d2h", self._clocks, delay("d2h", 1), link_bytes_per_s)
        self.h2d = _CpuCopyStream("h2d", self._clocks, delay("h2d", 2), reload_rate)
        self._finalizer = weakref.finalize(self, _stop_workers, self.d2h, self.h2d)

    def close(self) -> None:
        self._finalizer()


def _stop_workers(*streams: _CpuCopyStream) -> None:
    for stream in streams:
        stream.stop()


