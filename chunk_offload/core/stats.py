"""Stats: the counters the engine keeps over the whole run (bytes per group name, copy and wait
times, host pool bytes, resident bytes). What one iteration did is its record (`records.py`)."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field, replace
from typing import Callable

from .actions import Action
from .streams import Timing

__all__ = ["GroupStats", "HostPoolStats", "OffloadStats", "ResidentBytes", "StatsRecorder"]


@dataclass(frozen=True)
class HostPoolStats:
    """Byte counts of a `HostPool`."""

    allocated_bytes: int
    """Bytes of host memory the pool holds (in use or free)."""
    in_use_bytes: int
    """Bytes of pooled buffers handed out and not yet released."""
    allocations: int
    """Number of pooled host allocations made so far (flat once the shapes repeat)."""
    fallback_allocations: int
    """Number of unpooled allocations made because the pool was at its cap."""
    fallback_in_use_bytes: int
    """Bytes of unpooled fallback buffers handed out and not yet released."""
    evictions: int = 0
    """Number of free buffers released (idle, or to make room; NOTE [Host pool bound])."""
    freed_bytes: int = 0
    """Bytes of the free buffers released so far."""
    eviction_waits: int = 0
    """Releases that first waited on the host for the copy still reading the buffer."""
    peak_allocated_bytes: int = field(default=0, compare=False)
    """Most bytes the pool ever held (a high-water mark: not compared by ``==``)."""
    peak_requested_bytes: int = field(default=0, compare=False)
    """Most requested (unrounded) bytes ever in use at once: the run's largest need (not compared)."""


@dataclass
class GroupStats:
    """Totals for every group with one name (e.g. all ``core_attn`` calls)."""

    groups: int = 0
    """Groups opened and committed under this name."""
    tensors_offloaded: int = 0
    """Saved tensors whose copy to host was issued (views of one storage count each)."""
    bytes_offloaded: int = 0
    """Bytes copied to host (a storage shared by several saved views counts once)."""
    bytes_reloaded: int = 0
    """Bytes copied back to the device."""
    tensors_kept: int = 0
    """Saved tensors left on device by the policy (parameters, small, marked) or because
    another reference holds their storage (NOTE [Storages held elsewhere])."""
    bytes_copied_held_elsewhere: int = 0
    """Bytes copied to host whose device memory another reference kept alive: the copy freed
    nothing; such storages are kept on device from then on (NOTE [Storages held elsewhere])."""
    bytes_kept_held_elsewhere: int = 0
    """Bytes kept on device, uncopied and unaccounted, because another reference holds them."""
    offload_time_s: float = 0.0
    """Time the device-to-host copies took on their stream."""
    reload_time_s: float = 0.0
    """Time the host-to-device copies took on their stream."""
    wait_time_s: float = 0.0
    """Time compute waited on copies (offload before releasing, reload before use)."""

    @property
    def copy_time_s(self) -> float:
        """Offload plus reload copy time."""
        return self.offload_time_s + self.reload_time_s


@dataclass
class OffloadStats:
    """What `OffloadManager.stats` returns."""

    groups: dict[str, GroupStats]
    """Per group name."""
    peak_resident_bytes: int
    """High-water mark of device-resident saved bytes of offload groups."""
    host_bytes_at_peak: int
    """Bytes that were on host only (offloaded, not reloaded) at that high-water mark."""
    saved_bytes_at_peak: int
    """All saved bytes of offload groups alive at that moment (resident + host)."""
    peak_saved_bytes: int
    """High-water mark of saved bytes of offload groups wherever they live: the peak without offload."""
    host_bytes_at_saved_peak: int
    """Bytes on host only at the moment of `peak_saved_bytes`: the drop offload could give at most."""
    resident_bytes: int
    """Device-resident saved bytes now."""
    host_bytes: int
    """Host-only saved bytes now."""
    pool: HostPoolStats
    """The host pool's counters."""

    @property
    def bytes_offloaded(self) -> int:
        return sum(g.bytes_offloaded for g in self.groups.values())

    @classmethod
    def collect(cls, recorder: "StatsRecorder", resident: "ResidentBytes", pool: HostPoolStats) -> "OffloadStats":
        """The counters of ``recorder`` and the marks of ``resident``, each read at one moment."""
        now, host, peak, host_at_peak, saved_at_peak, saved_peak, host_at_saved_peak = resident.snapshot()
        return cls(
            groups=recorder.snapshot(),
            peak_resident_bytes=peak,
            host_bytes_at_peak=host_at_peak,
            saved_bytes_at_peak=saved_at_peak,
            peak_saved_bytes=saved_peak,
            host_bytes_at_saved_peak=host_at_saved_peak,
            resident_bytes=now,
            host_bytes=host,
            pool=pool,
        )


class _HighWater:
    """High-water marks of resident and of saved bytes, with the host bytes at each."""

    __slots__ = ("peak", "host_at_peak", "saved_at_peak", "saved_peak", "host_at_saved_peak")

    def __init__(self, resident: int = 0, host: int = 0) -> None:
        self.peak = resident
        self.host_at_peak = host
        self.saved_at_peak = resident + host
        self.saved_peak = resident + host
        self.host_at_saved_peak = host

    def update(self, resident: int, host: int, check_device: bool, check_saved: bool) -> None:
        # On a tie keep the moment with the most saved bytes: the stage's peak (most chunks in
        # flight), whose host bytes are the saving. With equal microbatches the device mark is
        # first reached in the first chunk's forward, when almost nothing is on host.
        if check_device and (resident > self.peak or (resident == self.peak and resident + host > self.saved_at_peak)):
            self.peak = resident
            self.host_at_peak = host
            self.saved_at_peak = resident + host
        saved = resident + host
        if check_saved and saved >= self.saved_peak:  # the latest moment at the peak: every release so far counted
            self.saved_peak = saved
            self.host_at_saved_peak = host


class ResidentBytes:
    """Accounting of where the saved bytes of offload groups live, and its high-water marks.

    Counted per storage span, deduplicated like the copies. ``saved = resident + host``
    holds at every moment. Marks are kept twice: since the last `reset_peak` (what
    `OffloadManager.stats` reports) and since the last `start_window` (one iteration's
    `IterationRecord`). With ``trace`` set, every change appends the resident bytes (and the
    value of ``device_bytes()``, e.g. ``torch.cuda.memory_allocated``) to the window's traces.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.resident = 0
        self.host = 0
        self.total = _HighWater()
        self.window = _HighWater()
        self.trace: list[int] | None = None
        self.device_trace: list[int] | None = None
        self.device_bytes: Callable[[], int] | None = None

    # The marks since reset_peak, under the names OffloadStats uses.
    peak = property(lambda self: self.total.peak)
    host_at_peak = property(lambda self: self.total.host_at_peak)
    saved_at_peak = property(lambda self: self.total.saved_at_peak)
    saved_peak = property(lambda self: self.total.saved_peak)
    host_at_saved_peak = property(lambda self: self.total.host_at_saved_peak)

    def _traced(self) -> None:
        """Append the current bytes to the window's traces (only while ``trace`` is on)."""
        self.trace.append(self.resident)
        if self.device_trace is not None and self.device_bytes is not None:
            self.device_trace.append(self.device_bytes())

    # Each change updates only the marks it can raise; the pack and release paths call these
    # once per group or storage, so they take positional arguments and test the trace inline.
    def saved(self, nbytes: int) -> None:
        with self._lock:
            resident = self.resident = self.resident + nbytes
            self.total.update(resident, self.host, True, True)
            self.window.update(resident, self.host, True, True)
            if self.trace is not None:
                self._traced()

    def moved_to_host(self, nbytes: int) -> None:
        with self._lock:
            self.resident -= nbytes
            self.host += nbytes
            self.total.update(self.resident, self.host, False, True)
            self.window.update(self.resident, self.host, False, True)
            if self.trace is not None:
                self._traced()

    def moved_to_device(self, nbytes: int) -> None:
        with self._lock:
            self.host -= nbytes
            self.resident += nbytes
            self.total.update(self.resident, self.host, True, False)
            self.window.update(self.resident, self.host, True, False)
            if self.trace is not None:
                self._traced()

    def freed(self, nbytes: int, on_host: bool) -> None:
        """A release raises no mark: only the counters (and the trace) change."""
        with self._lock:
            if on_host:
                self.host -= nbytes
            else:
                self.resident -= nbytes
            if self.trace is not None:
                self._traced()

    def snapshot(self) -> tuple[int, int, int, int, int, int, int]:
        """``(resident, host, peak, host_at_peak, saved_at_peak, saved_peak, host_at_saved_peak)``
        read at one moment (under the lock every change takes), for a reader on any thread."""
        with self._lock:
            t = self.total
            return self.resident, self.host, t.peak, t.host_at_peak, t.saved_at_peak, t.saved_peak, t.host_at_saved_peak

    def reset_peak(self) -> None:
        with self._lock:
            self.total = _HighWater(self.resident, self.host)

    def start_window(self, *, trace: bool, device_bytes: Callable[[], int] | None = None) -> None:
        """Restart the window's marks from now; record traces in it when ``trace``."""
        with self._lock:
            self.window = _HighWater(self.resident, self.host)
            self.trace = [self.resident] if trace else None
            self.device_bytes = device_bytes
            self.device_trace = [device_bytes()] if trace and device_bytes is not None else None


class StatsRecorder:
    """Per-name counters plus copy/wait timings that are folded in once they are known.

    The engine adds to the counters of a group on the training thread; `fold` and `snapshot` may
    run on any thread (a monitor reading `OffloadManager.stats` while iterations run). Folds are
    serialised by a lock, so a timing is added exactly once and a fold that returns has added
    every timing issued before it started; pending timings sit in a deque, whose ``append`` and
    ``popleft`` are atomic, so the engine's side takes no lock.
    """

    def __init__(self) -> None:
        self.groups: dict[str, GroupStats] = {}
        self._pending: collections.deque[tuple[str, str, Timing]] = collections.deque()
        self._fold_lock = threading.Lock()

    def group(self, name: str) -> GroupStats:
        stats = self.groups.get(name)
        if stats is None:
            stats = self.groups[name] = GroupStats()
        return stats

    def timing(self, name: str, kind: str, timing: Timing | None) -> None:
        if timing is not None:
            self._pending.append((name, kind, timing))

    def fold(self, *, device_idle: bool = False) -> None:
        """Add the pending timings (blocks until their copies are done).

        NOTE [Reads after the device synchronised]
        A CUDA timing's elapsed time can be read only once both its events are done, so a read
        first waits for them on the host (``cudaEventSynchronize``, one or two per timing: about
        three per offloaded group and iteration). At an iteration's end with ``measure_time``
        the window has just synchronised the whole device (`IterationWindow.finish`): every
        event recorded before is done, so the fold that follows passes ``device_idle`` and reads
        the times without those waits, and so do the action marks read there. A fold anywhere
        else (`OffloadManager.stats` on a monitor thread, or after only the copy streams were
        synchronised) still waits: a timed compute wait starts on compute, which nothing
        synchronised.
        """
        pending = self._pending
        with self._fold_lock:
            while pending:
                name, kind, timing = pending.popleft()
                stats = self.group(name)
                setattr(stats, kind, getattr(stats, kind) + timing.seconds(device_idle=device_idle))

    def snapshot(self) -> dict[str, GroupStats]:
        """A copy of the counters per name, taken while no fold runs."""
        with self._fold_lock:
            return {name: replace(g) for name, g in list(self.groups.items())}

    def clear(self) -> None:
        """Zero every counter (`OffloadManager.reset_stats`, after a fold)."""
        with self._fold_lock:
            self.groups.clear()
