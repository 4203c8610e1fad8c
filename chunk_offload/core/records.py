"""`IterationWindow`: what one iteration did, measured between its start and its end.

Besides the counters, the window records the order in which chunks start forward and backward
(`note_action`) and when each started, from the iteration's start: the measured compute time
between a group's forward and its backward that `chunk_offload.schedule.CopyTiming` reads.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

import torch

from .actions import Action
from .config import OffloadConfig
from .handler import ChunkOffloadHandler
from .stats import GroupStats, IterationRecord, ResidentBytes, StatsRecorder
from .streams import StreamBackend

__all__ = ["IterationWindow"]


class IterationWindow:
    """The counters at an iteration's start, and its `IterationRecord` at its end."""

    def __init__(self, streams: StreamBackend, config: OffloadConfig, resident: ResidentBytes, stats: StatsRecorder) -> None:
        self.streams = streams
        self.config = config
        self.resident = resident
        self.stats = stats
        cuda = streams.device.type == "cuda"
        self._cuda = cuda
        if cuda:
            # The allocator's statistics are kept on the host at allocation time: no device sync
            # is needed for them; the wall time (measure_time) needs one at both ends.
            if config.measure_time:
                torch.cuda.synchronize(streams.device)
            torch.cuda.reset_peak_memory_stats(streams.device)
        device_bytes = (lambda: torch.cuda.memory_allocated(streams.device)) if cuda else None
        resident.start_window(trace=config.trace, device_bytes=device_bytes)
        streams.synchronize()
        stats.fold()
        self._before = {name: replace(g) for name, g in stats.groups.items()}
        self.order: list[Action] = []
        """The F and B actions so far, as the engine saw chunks start forward and backward."""
        self.action_starts_s: list[float] = []
        """For each entry of ``order``: seconds from the iteration's start at which it began."""
        self._started = time.perf_counter()

    def note_action(self, action: Action) -> None:
        """A chunk starts forward, or backward first reached one of its groups."""
        self.action_starts_s.append(time.perf_counter() - self._started)
        self.order.append(action)

    def finish(self, *, offload: bool, handlers: Sequence[ChunkOffloadHandler]) -> IterationRecord:
        """Wait for the copies and describe the iteration: peaks, traces, bytes per group."""
        streams = self.streams
        streams.synchronize()
        if self._cuda and self.config.measure_time:
            torch.cuda.synchronize(streams.device)
        wall = time.perf_counter() - self._started
        self.stats.fold()
        groups = {}
        for name, now in self.stats.groups.items():
            was = self._before.get(name, GroupStats())
            groups[name] = GroupStats(**{f: getattr(now, f) - getattr(was, f) for f in GroupStats.__dataclass_fields__})
        window = self.resident.window
        return IterationRecord(
            offload=offload,
            peak_resident_bytes=window.peak,
            peak_saved_bytes=window.saved_peak,
            host_bytes_at_saved_peak=window.host_at_saved_peak,
            device_peak_bytes=torch.cuda.max_memory_allocated(streams.device) if self._cuda else None,
            resident_trace=self.resident.trace,
            device_trace=self.resident.device_trace,
            group_bytes={tuple(h.key): h.group_bytes() for h in handlers},
            group_names={tuple(h.key): [g.name for g in h.groups] for h in handlers},
            group_kept_bytes={tuple(h.key): h.group_kept_bytes() for h in handlers},
            groups=groups,
            order=list(self.order),
            action_starts_s=list(self.action_starts_s),
            wall_time_s=wall,
        )
