"""`IterationWindow`: one iteration's chunks, and what it did between its start and its end.

The window opens the iteration's chunks with the schedule policy's decisions and keeps their
handlers by key (a policy's prefetch names chunks by key). Besides the counters, it records the
order in which chunks start forward and backward (`note_action`) and when each started, from the
iteration's start: the measured compute time between a group's forward and its backward that
`chunk_offload.schedule.CopyTiming` reads.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Iterable

import torch

from .actions import Action, ActionKind, ChunkKey
from .config import OffloadConfig
from .engine_context import EngineContext
from .handler import ChunkOffloadHandler
from .schedule_policy import SchedulePolicy
from .records import IterationRecord
from .stats import GroupStats, ResidentBytes, StatsRecorder
from .streams import StreamBackend, TimeMark
from .streams.base import host_time_mark

__all__ = ["IterationWindow"]


class IterationWindow:
    """The counters at an iteration's start, its chunks, and its `IterationRecord` at its end.

    ``offload=False``: a baseline iteration (its chunks copy nothing).
    """

    def __init__(
        self, streams: StreamBackend, config: OffloadConfig, resident: ResidentBytes, stats: StatsRecorder, *, offload: bool
    ) -> None:
        self.offload = offload
        self.handlers: list[ChunkOffloadHandler] = []
        """The chunk handlers of the iteration, in forward order."""
        self._by_key: dict[ChunkKey, ChunkOffloadHandler] = {}
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
        self._before = stats.snapshot()
        self._probing = None  # the places a baseline's chunks probe (NOTE [Storages held elsewhere])
        self.order: list[Action] = []
        """The F and B actions so far, as the engine saw chunks start forward and backward."""
        # When each entry of ``order`` began, on compute's timeline (NOTE [Action times]): device
        # marks only with measure_time, whose end-of-iteration sync reads them for free.
        self._time_mark: Callable[[], TimeMark] = streams.time_mark if config.measure_time else host_time_mark
        self._action_marks: list[TimeMark] = []
        self._start_mark = self._time_mark()
        self._started = time.perf_counter()

    def open_chunk(self, ctx: EngineContext, policy: SchedulePolicy, key: ChunkKey) -> ChunkOffloadHandler:
        """The handler of a chunk whose forward starts now, with ``policy``'s decisions for it."""
        self.note_action(Action(ActionKind.FORWARD, key.microbatch, key.vp_stage))
        self.prefetch(policy.prefetch_on("F", key))
        offload = self.offload and policy.offload_chunk(key)
        # Per-group decisions only from a policy that makes them: the base class copies every group.
        per_group = offload and type(policy).offload_group is not SchedulePolicy.offload_group
        # The first baseline iteration probes its chunks: NOTE [Storages held elsewhere].
        probe = not self.offload and not ctx.held_elsewhere.probed
        if probe:
            self._probing = ctx.held_elsewhere
        handler = ChunkOffloadHandler(
            ctx,
            key,
            offload=offload,
            reload_ahead_bytes=policy.reload_ahead_bytes(key),
            offload_group=functools.partial(policy.offload_group, key) if per_group else None,
            probe_held=probe,
        )
        self._by_key[key] = handler  # a chunk key entered twice (no schedule does that) maps to its latest forward
        self.handlers.append(handler)
        return handler

    def prefetch(self, requests: Iterable[tuple[tuple[int, int], int | None]]) -> None:
        """Start the reloads a policy asks for, by chunk key, within each one's byte budget."""
        for key, budget in requests:
            handler = self._by_key.get(ChunkKey(*key))
            if handler is not None:  # a chunk that did not run forward (a plan that is wrong) is skipped
                handler.prefetch(budget)

    def discard(self) -> None:
        """Discard every chunk of the iteration (its saved tensors can no longer be unpacked)."""
        for handler in self.handlers:
            handler.abort()

    def note_action(self, action: Action) -> None:
        """A chunk starts forward, or backward first reached one of its groups."""
        self._action_marks.append(self._time_mark())
        self.order.append(action)

    def finish(self) -> IterationRecord:
        """Wait for the copies and describe the iteration: peaks, traces, bytes per group."""
        streams = self.streams
        streams.synchronize()
        device_idle = self._cuda and self.config.measure_time
        if device_idle:
            torch.cuda.synchronize(streams.device)
        wall = time.perf_counter() - self._started
        if self._probing is not None:
            self._probing.probed = True
        self.stats.fold(device_idle=device_idle)  # NOTE [Reads after the device synchronised] in stats.py
        groups = {}
        for name, now in self.stats.snapshot().items():
            was = self._before.get(name, GroupStats())
            groups[name] = GroupStats(**{f: getattr(now, f) - getattr(was, f) for f in GroupStats.__dataclass_fields__})
        window = self.resident.window
        handlers = self.handlers
        return IterationRecord(
            offload=self.offload,
            peak_resident_bytes=window.peak,
            peak_saved_bytes=window.saved_peak,
            host_bytes_at_saved_peak=window.host_at_saved_peak,
            device_peak_bytes=torch.cuda.max_memory_allocated(streams.device) if self._cuda else None,
            resident_trace=self.resident.trace,
            device_trace=self.resident.device_trace,
            group_bytes={tuple(h.key): h.group_bytes() for h in handlers},
            group_names={tuple(h.key): [g.name for g in h.groups] for h in handlers},
            group_kept_bytes={tuple(h.key): h.group_kept_bytes() for h in handlers},
            group_learned_bytes={tuple(h.key): h.group_learned_bytes() for h in handlers},
            group_shared={tuple(h.key): shared for h in handlers if (shared := h.group_shared()) is not None},
            groups=groups,
            order=list(self.order),
            action_starts_s=[mark.seconds_since(self._start_mark, device_idle=device_idle) for mark in self._action_marks],
            wall_time_s=wall,
        )
