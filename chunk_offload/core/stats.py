"""Counters the engine keeps: bytes per group name, copy and wait times, resident bytes."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .host_pool import HostPoolStats
from .streams import Timing

__all__ = ["GroupStats", "OffloadStats", "ResidentBytes", "StatsRecorder"]


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
    """Saved tensors left on device by the policy (parameters, small, marked)."""
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


class ResidentBytes:
    """Accounting of where the saved bytes of offload groups live, and its high-water mark.

    Counted per storage span, deduplicated like the copies. ``saved = resident + host``
    holds at every moment. Two high-water marks: of ``resident`` (what the device holds) and
    of ``saved`` (what it would hold without offload), with the host bytes at each.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.resident = 0
        self.host = 0
        self.peak = 0
        self.host_at_peak = 0
        self.saved_at_peak = 0
        self.saved_peak = 0
        self.host_at_saved_peak = 0

    def _update_peak(self) -> None:
        # On a tie keep the moment with the most saved bytes: the stage's peak (most chunks in
        # flight), whose host bytes are the saving. With equal microbatches the device mark is
        # first reached in the first chunk's forward, when almost nothing is on host.
        if self.resident > self.peak or (self.resident == self.peak and self.resident + self.host > self.saved_at_peak):
            self.peak = self.resident
            self.host_at_peak = self.host
            self.saved_at_peak = self.resident + self.host

    def _update_saved_peak(self) -> None:
        saved = self.resident + self.host
        if saved >= self.saved_peak:  # the latest moment at the peak: every release so far counted
            self.saved_peak = saved
            self.host_at_saved_peak = self.host

    def saved(self, nbytes: int) -> None:
        with self._lock:
            self.resident += nbytes
            self._update_peak()
            self._update_saved_peak()

    def moved_to_host(self, nbytes: int) -> None:
        with self._lock:
            self.resident -= nbytes
            self.host += nbytes
            self._update_saved_peak()

    def moved_to_device(self, nbytes: int) -> None:
        with self._lock:
            self.host -= nbytes
            self.resident += nbytes
            self._update_peak()

    def freed(self, nbytes: int, *, on_host: bool) -> None:
        with self._lock:
            if on_host:
                self.host -= nbytes
            else:
                self.resident -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.resident
            self.host_at_peak = self.host
            self.saved_at_peak = self.resident + self.host
            self.saved_peak = self.resident + self.host
            self.host_at_saved_peak = self.host


@dataclass
class StatsRecorder:
    """Per-name counters plus copy/wait timings that are folded in once they are known."""

    groups: dict[str, GroupStats] = field(default_factory=dict)
    _pending: list[tuple[str, str, Timing]] = field(default_factory=list)

    def group(self, name: str) -> GroupStats:
        stats = self.groups.get(name)
        if stats is None:
            stats = self.groups[name] = GroupStats()
        return stats

    def timing(self, name: str, kind: str, timing: Timing | None) -> None:
        if timing is not None:
            self._pending.append((name, kind, timing))

    def fold(self) -> None:
        """Add the pending timings (blocks until their copies are done)."""
        pending, self._pending = self._pending, []
        for name, kind, timing in pending:
            stats = self.group(name)
            setattr(stats, kind, getattr(stats, kind) + timing.seconds())
