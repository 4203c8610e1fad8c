"""`OffloadManager`: the one object a training run creates to offload activations.

It owns the streams, the host pool, the policy, the chunk handlers of the current
iteration and the statistics. There is no global instance: each manager is explicit.

Scopes are explicit method pairs: `begin_iteration` / `end_iteration` around one optimizer
step, `begin_chunk` / `end_chunk` around one chunk's forward. `iteration()` and `chunk()` are
thin ``with`` wrappers over them (an exception discards the iteration, or aborts the chunk).
Integrations drive the pairs from their hooks and read the public properties (`in_iteration`,
`closed`, `iteration_handlers`, `current_handler`, `module_offloads`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from typing import Any, Iterator

import torch
from torch import nn

from .actions import Action, ActionKind, ChunkKey
from .config import OffloadConfig
from .errors import ChunkOffloadError
from .engine_context import EngineContext
from .handler import ChunkOffloadHandler
from .held_elsewhere import HeldElsewhere
from .host_pool import HostPool
from .marks import GroupMarks, ModuleOffload
from .tensor_policy import OffloadPolicy
from .records import IterationWindow
from .schedule_policy import SchedulePolicy
from .stats import IterationRecord, OffloadStats, ResidentBytes, StatsRecorder
from .streams import StreamBackend, default_streams

__all__ = ["OffloadManager"]


class OffloadManager:
    """Offloads what chosen submodules save for backward, per (microbatch, virtual stage) chunk.

    Example::

        mgr = OffloadManager(OffloadConfig(min_offload_bytes=1 << 20))
        mgr.offload_module(layer.self_attention.core_attention, "core_attn")
        with mgr.iteration():
            with mgr.chunk(microbatch=0, vp_stage=0):
                loss = model(x)
            loss.backward()

    Args:
        config: the options (`OffloadConfig`); None: the defaults.
        streams: the stream backend; default CUDA streams when CUDA is available, else CPU
            worker-thread streams.
        schedule_policy: which chunks to offload and what to reload ahead, from the pipeline
            schedule (`chunk_offload.schedule.PlanPolicy`); default offload every chunk and
            reload one group ahead in backward.
    """

    def __init__(
        self,
        config: OffloadConfig | None = None,
        *,
        streams: StreamBackend | None = None,
        schedule_policy: SchedulePolicy | None = None,
    ) -> None:
        if config is None:
            config = OffloadConfig()
        if not isinstance(config, OffloadConfig):
            raise ChunkOffloadError(
                f"config must be an OffloadConfig (fields {OffloadConfig.field_names()}), got {type(config).__name__} {config!r:.200}"
            )
        config.validate()
        if schedule_policy is not None and not isinstance(schedule_policy, SchedulePolicy):
            raise ChunkOffloadError(
                f"schedule_policy must be a chunk_offload SchedulePolicy (e.g. chunk_offload.schedule.PlanPolicy), "
                f"got {type(schedule_policy).__name__}"
            )
        self.config = config
        if streams is not None and not isinstance(streams, StreamBackend):
            raise ChunkOffloadError(
                f"OffloadManager(streams=...) takes a StreamBackend (CudaStreams, CpuStreams) or None, "
                f"got {streams!r}"
            )
        self.streams = streams if streams is not None else default_streams()
        self.pool = HostPool(
            capacity_bytes=self.config.host_pool_bytes,
            pin_memory=self.streams.pin_memory,
            on_exhausted=self.config.on_exhausted,
        )
        self.schedule_policy = schedule_policy if schedule_policy is not None else SchedulePolicy()
        self.policy = OffloadPolicy(min_offload_bytes=self.config.min_offload_bytes, device_type=self.streams.device.type)
        self._resident = ResidentBytes()
        self._stats = StatsRecorder()
        self._ctx = EngineContext(
            streams=self.streams,
            pool=self.pool,
            offload_key=self.policy.offload_key,
            resident=self._resident,
            stats=self._stats,
            held_elsewhere=HeldElsewhere(),
            on_backward_start=self._on_backward_start,
            measure_time=self.config.measure_time,
            deterministic_memory=self.config.deterministic_memory,
            profile_ranges=self.config.profile_ranges,
        )
        self._marks = GroupMarks()
        self._window: IterationWindow | None = None  # not None while an iteration is open
        self._current: ChunkOffloadHandler | None = None
        self._untracked_chunks = 0  # open chunk scopes that track nothing (no grad)
        self._iteration_handlers: list[ChunkOffloadHandler] = []
        self._live_handlers: list[ChunkOffloadHandler] = []
        self._closed = False
        self._registrations: list[ModuleOffload] = []
        self._iteration_offload = self.config.offload
        self._by_key: dict[ChunkKey, ChunkOffloadHandler] = {}
        self.last_iteration: IterationRecord | None = None
        """What the last iteration that completed did (peaks, traces, bytes per group)."""

    # ------------------------------------------------------------------ registration
    def offload_module(self, module: nn.Module, name: str) -> ModuleOffload:
        """Offload, as one group named ``name``, what each call of ``module`` saves for backward.

        The module's own parameters and buffers are protected. Returns a handle whose
        ``remove()`` undoes the registration.
        """
        if not isinstance(module, nn.Module):
            raise ChunkOffloadError(f"offload_module expects an nn.Module, got {type(module).__name__}")
        if not isinstance(name, str) or not name:
            raise ChunkOffloadError(f"offload_module needs a non-empty group name, got {name!r}")
        for existing in self._registrations:
            if existing.module is module:
                raise ChunkOffloadError(
                    f"offload_module: this {type(module).__name__} is already offloaded as group "
                    f"{existing.name!r}; cannot register it again as {name!r} (one group per module: "
                    "remove() the first registration, or offload a parent or child module instead)"
                )
        self.policy.protect(module)
        registrations, held_elsewhere = self._registrations, self._ctx.held_elsewhere

        def removed(registration: ModuleOffload) -> None:  # holds no manager: its hooks must not keep it alive
            registrations.remove(registration)
            held_elsewhere.clear()

        registration = ModuleOffload(self, module, name, marks=self._marks, on_remove=removed)
        registrations.append(registration)
        held_elsewhere.clear()  # the groups' indices within a chunk change
        return registration

    def protect_module(self, module: nn.Module) -> None:
        """Never offload parameters or buffers of ``module`` (or views of their storage)."""
        self.policy.protect(module)

    @property
    def module_offloads(self) -> tuple[ModuleOffload, ...]:
        """The registrations of `offload_module` not removed yet."""
        return tuple(self._registrations)

    # ------------------------------------------------------------------ state
    @property
    def in_iteration(self) -> bool:
        """Whether an iteration is open (between `begin_iteration` and `end_iteration`)."""
        return self._window is not None

    @property
    def closed(self) -> bool:
        """Whether `close` ran."""
        return self._closed

    @property
    def iteration_handlers(self) -> tuple[ChunkOffloadHandler, ...]:
        """The chunk handlers of the open iteration, in forward order (empty outside one)."""
        return tuple(self._iteration_handlers)

    @property
    def current_handler(self) -> ChunkOffloadHandler | None:
        """The handler of the chunk whose forward is running, if any."""
        return self._current

    # ------------------------------------------------------------------ iteration scope
    def begin_iteration(self, *, offload: bool | None = None) -> None:
        """Open one optimizer step's forwards and backwards.

        ``offload=False`` makes this iteration a baseline: the same groups and bytes are
        tracked, nothing is copied (None: `OffloadConfig.offload`).
        """
        if self._closed:
            raise ChunkOffloadError("iteration() on a closed OffloadManager; create a new manager.")
        if self.in_iteration:
            raise ChunkOffloadError("iteration() entered while an iteration is already open; they cannot nest.")
        if offload is not None and not isinstance(offload, bool):
            raise ChunkOffloadError(f"iteration(offload=...) takes True, False or None, got {offload!r}")
        self.policy.refresh()
        self._iteration_offload = self.config.offload if offload is None else offload
        self.schedule_policy.begin_iteration()
        self._iteration_handlers = []
        self._by_key = {}
        self._window = IterationWindow(self.streams, self.config, self._resident, self._stats)

    def end_iteration(self, *, discard: bool = False) -> IterationRecord | None:
        """Close the open iteration and return its record (also kept in `last_iteration`).

        ``discard=True`` (an exception, or a step given up): every chunk of it is discarded
        now (its saved tensors can no longer be unpacked) and no record is made (None).
        """
        if not self.in_iteration:
            raise ChunkOffloadError("end_iteration() without an open iteration; call begin_iteration() first.")
        try:
            if discard:
                self._discard_iteration()
                return None
            try:
                record = self._window.finish(offload=self._iteration_offload, handlers=self._iteration_handlers)
            except BaseException:
                self._discard_iteration()
                raise
            self.last_iteration = record
            return record
        finally:
            self._window = None
            self._live_handlers = [h for h in (*self._live_handlers, *self._iteration_handlers) if not h.released]
            self._iteration_handlers = []
            self._by_key = {}

    def _discard_iteration(self) -> None:
        for handler in self._iteration_handlers:
            handler.abort()

    @contextlib.contextmanager
    def iteration(self, *, offload: bool | None = None) -> Iterator["OffloadManager"]:
        """`begin_iteration` ... `end_iteration` as a ``with`` block; an exception discards the iteration."""
        self.begin_iteration(offload=offload)
        try:
            yield self
        except BaseException:
            if self.in_iteration:  # `close` inside the block already discarded it
                self.end_iteration(discard=True)
            raise
        if self.in_iteration:
            self.end_iteration()

    def group_bytes(self) -> dict[tuple[int, int], list[int]]:
        """(microbatch, vp_stage) -> saved bytes per group, in forward order, of the last iteration."""
        return dict(self.last_iteration.group_bytes) if self.last_iteration is not None else {}

    # ------------------------------------------------------------------ chunk scope
    def begin_chunk(self, *, microbatch: int, vp_stage: int = 0) -> ChunkOffloadHandler | None:
        """Open the forward of one microbatch through one model chunk (virtual stage) of this rank.

        Returns the chunk's handler; under ``torch.no_grad()`` or inference mode nothing is
        tracked and None is returned. Every `begin_chunk` needs its `end_chunk`.
        """
        if not self.in_iteration:
            raise ChunkOffloadError("chunk() must be used inside `with manager.iteration():`.")
        if self._current is not None:
            raise ChunkOffloadError(
                f"chunk(microbatch={microbatch}, vp_stage={vp_stage}) entered inside chunk {self._current.key}; "
                "chunks cannot nest."
            )
        for label, value in (("microbatch", microbatch), ("vp_stage", vp_stage)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ChunkOffloadError(f"chunk() needs {label} as an int >= 0, got {value!r}")
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            self._untracked_chunks += 1
            return None
        key = ChunkKey(microbatch, vp_stage)
        self._window.note_action(Action(ActionKind.FORWARD, microbatch, vp_stage))
        self._prefetch(self.schedule_policy.prefetch_on("F", key))
        policy = self.schedule_policy
        offload = self._iteration_offload and policy.offload_chunk(key)
        # Per-group decisions only from a policy that makes them: the base class copies every group.
        per_group = offload and type(policy).offload_group is not SchedulePolicy.offload_group
        handler = ChunkOffloadHandler(
            self._ctx,
            key,
            offload=offload,
            reload_ahead_bytes=policy.reload_ahead_bytes(key),
            offload_group=functools.partial(policy.offload_group, key) if per_group else None,
        )
        self._by_key[key] = handler  # a chunk key entered twice (no schedule does that) maps to its latest forward
        self._iteration_handlers.append(handler)
        self._current = handler
        return handler

    def end_chunk(self, *, abort: bool = False) -> ChunkOffloadHandler | None:
        """Close the chunk `begin_chunk` opened: release its groups' device tensors.

        ``abort=True`` (its forward raised): discard the chunk's groups instead. Returns the
        chunk's handler (None for a chunk that tracked nothing).
        """
        handler = self._current
        if handler is None:
            if self._untracked_chunks == 0:
                raise ChunkOffloadError("end_chunk() without an open chunk; call begin_chunk() first.")
            self._untracked_chunks -= 1
            return None
        try:
            self._marks.pop_all()
            if abort:
                handler.abort()
            else:
                try:
                    handler.finish_forward()
                except BaseException:
                    handler.abort()
                    raise
        finally:
            self._current = None
        return handler

    @contextlib.contextmanager
    def chunk(self, *, microbatch: int, vp_stage: int = 0) -> Iterator[ChunkOffloadHandler | None]:
        """`begin_chunk` ... `end_chunk` as a ``with`` block; an exception aborts the chunk."""
        handler = self.begin_chunk(microbatch=microbatch, vp_stage=vp_stage)
        try:
            yield handler
        except BaseException:
            self.end_chunk(abort=True)
            raise
        self.end_chunk()

    def _on_backward_start(self, handler: ChunkOffloadHandler) -> None:
        if self.in_iteration:  # a backward after its iteration ended (outside any) is not recorded
            self._window.note_action(Action(ActionKind.BACKWARD, handler.key.microbatch, handler.key.vp_stage))
            self._prefetch(self.schedule_policy.prefetch_on("B", handler.key))

    def _prefetch(self, requests) -> None:
        for key, budget in requests:
            handler = self._by_key.get(ChunkKey(*key))
            if handler is not None:  # a chunk that did not run forward (a plan that is wrong) is skipped
                handler.prefetch(budget)

    # ------------------------------------------------------------------ low-level marks
    def group_start(self, tensors: Any, name: str) -> Any:
        """Open group ``name`` on ``tensors`` (a tensor or a tuple/list of them); returns them.

        Until `group_commit`, what autograd saves goes to the group. Outside a chunk, or with
        gradients disabled, this returns ``tensors`` unchanged.
        """
        return self._marks.start(self._current, tensors, name)

    def group_commit(self, tensors: Any, name: str) -> Any:
        """Commit group ``name`` on its outputs ``tensors`` and start its offload; returns them."""
        return self._marks.commit(self._current, tensors, name)

    # ------------------------------------------------------------------ results
    def stats(self) -> OffloadStats:
        """Counters per group name and the resident-bytes high-water mark (waits for copies)."""
        if not self._closed:  # after close() the copies are done and the workers are gone
            self.streams.synchronize()
        self._stats.fold()
        resident = self._resident
        return OffloadStats(
            groups={name: replace(g) for name, g in self._stats.groups.items()},
            peak_resident_bytes=resident.peak,
            host_bytes_at_peak=resident.host_at_peak,
            saved_bytes_at_peak=resident.saved_at_peak,
            peak_saved_bytes=resident.saved_peak,
            host_bytes_at_saved_peak=resident.host_at_saved_peak,
            resident_bytes=resident.resident,
            host_bytes=resident.host,
            pool=self.pool.stats(),
        )

    def reset_stats(self) -> None:
        """Zero the per-name counters and restart the high-water mark from now."""
        if not self._closed:
            self.streams.synchronize()
        self._stats.fold()
        self._stats.groups.clear()
        self._resident.reset_peak()

    def live_chunks(self) -> list[ChunkKey]:
        """Chunks whose saved tensors are still held (their backward has not consumed them all)."""
        handlers = (*self._live_handlers, *self._iteration_handlers)
        return [h.key for h in handlers if not h.released]

    def close(self) -> None:
        """Wait for the copies and stop the stream workers (idempotent).

        Inside an open iteration, its open chunk is aborted and the iteration discarded first
        (no saved-tensor hook and no host buffer stays), so an enclosing ``with`` block exits
        quietly or re-raises its own exception.
        """
        if self._closed:
            return
        try:
            if self._current is not None:
                self.end_chunk(abort=True)
            if self.in_iteration:
                self.end_iteration(discard=True)
        finally:
            self._closed = True
            self.policy.forget_protected()
            self.streams.synchronize()
            self.streams.close()
