"""`OffloadManager`: the one object a training run creates to offload activations.

It owns the streams, the host pool, the tensor filter, the schedule policy, the chunk handlers of
the iteration, the stats and the iteration records; there is no global instance.

Scopes are method pairs: `begin_iteration` / `end_iteration` around one optimizer step, `begin_chunk`
/ `end_chunk` around one chunk's forward; ``with`` `iteration()` / `chunk()` wrap them (an exception
discards the iteration, or aborts the chunk). Integrations drive the pairs from their hooks and read
the public properties (`in_iteration`, `closed`, `iteration_handlers`, `current_handler`, `module_offloads`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
from torch import nn

from .actions import Action, ActionKind, ChunkKey
from .config import OffloadConfig
from .engine_context import EngineContext
from .errors import ChunkOffloadError, renamed_attributes
from .handler import ChunkOffloadHandler, let_go_of_released
from .held_elsewhere import HeldElsewhere
from .host_pool import HostPool
from .iteration_window import IterationWindow
from .manager_args import check_begin_chunk, check_begin_iteration, check_flag, check_manager_args, check_module, checked_regroup
from .marks import GroupMarks, ModuleOffload, check_group_args
from .records import IterationRecord
from .registry import ModuleRegistry
from .schedule_policy import SchedulePolicy
from .shutdown import run_cleanup
from .stats import OffloadStats, ResidentBytes, StatsRecorder
from .streams import StreamBackend, default_streams
from .tensor_filter import TensorFilter
from .thread_scope import ThreadScope

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
        schedule_policy: which chunks to offload and what to reload ahead (`schedule.PlanPolicy`);
            default offload every chunk and reload one group ahead in backward.
    """

    def __init__(
        self,
        config: OffloadConfig | None = None,
        *,
        streams: StreamBackend | None = None,
        schedule_policy: SchedulePolicy | None = None,
    ) -> None:
        self.config = check_manager_args(config, streams, schedule_policy)
        self.streams = streams if streams is not None else default_streams()
        self.pool = HostPool(  # messages name what the user set (host_pool_bytes), not the pool's argument
            capacity_bytes=self.config.host_pool_bytes, pin_memory=self.streams.pin_memory,
            on_exhausted=self.config.on_exhausted, cap_name="host_pool_bytes",
        )  # fmt: skip
        self.schedule_policy = schedule_policy if schedule_policy is not None else SchedulePolicy()
        self.tensor_filter = TensorFilter(min_offload_bytes=self.config.min_offload_bytes, device_type=self.streams.device.type)
        self._resident = ResidentBytes()
        self._stats = StatsRecorder()
        self._ctx = EngineContext(
            streams=self.streams,
            pool=self.pool,
            decide=self.tensor_filter.decide,
            resident=self._resident,
            stats=self._stats,
            held_elsewhere=HeldElsewhere(),
            on_backward_start=self._on_backward_start,
            measure_time=self.config.measure_time, deterministic_memory=self.config.deterministic_memory,
            profile_ranges=self.config.profile_ranges, layer_group_bytes=self.config.layer_group_bytes,
            slab_bytes=self.config.group_slab_bytes,
        )
        self._marks = GroupMarks()
        self._threads = ThreadScope()  # the training thread, and the thread of the open chunk
        self._chunk_local = self._threads.chunk  # the open chunk's handler, on the thread that opened it
        self._window: IterationWindow | None = None  # not None while an iteration is open
        self._current: ChunkOffloadHandler | None = None
        self._untracked_chunks = 0  # open chunk scopes that track nothing (no grad)
        self._live_handlers: list[ChunkOffloadHandler] = []
        self._closed = False
        self._registry = ModuleRegistry(self._marks, self._ctx.held_elsewhere)
        self.last_iteration: IterationRecord | None = None
        """What the last iteration that completed did (peaks, traces, bytes per group)."""

    # ------------------------------------------------------------------ registration
    def offload_module(self, module: nn.Module, name: str, *, layer: nn.Module | None = None, joins: str | None = None) -> ModuleOffload:
        """Offload, as one group named ``name``, what each call of ``module`` saves for backward.

        ``layer``: the layer ``module`` belongs to; with ``OffloadConfig.group_by="layer"`` the calls
        of one layer's modules form one group (NOTE [Layer groups] in marks.py). ``joins``: a module
        of ``layer`` whose call this one follows and saves a storage of (NOTE [Joined calls]). Its own
        parameters and buffers are protected. Returns a handle whose ``remove()`` undoes it (`close` too).
        """
        registration = self._registry.add(self, module, name, layer, group_by=self.config.group_by, joins=joins)
        self.tensor_filter.protect(module)
        return registration

    def protect_module(self, module: nn.Module) -> None:
        """Never offload parameters or buffers of ``module`` (or views of their storage)."""
        check_module("protect_module", module)
        self.tensor_filter.protect(module)

    @property
    def module_offloads(self) -> tuple[ModuleOffload, ...]:
        """The registrations of `offload_module` not removed yet."""
        return tuple(self._registry.registrations)

    # ------------------------------------------------------------------ state
    __getattr__ = renamed_attributes({"policy": "tensor_filter"})  # until 0.1; warns for one release

    @property
    def in_iteration(self) -> bool:
        """Whether an iteration is open (between `begin_iteration` and `end_iteration`)."""
        return self._window is not None

    closed = property(lambda self: self._closed, doc="Whether `close` ran.")

    @property
    def iteration_handlers(self) -> tuple[ChunkOffloadHandler, ...]:
        """The chunk handlers of the open iteration, in forward order (empty outside one)."""
        return tuple(self._window.handlers) if self._window is not None else ()

    @property
    def current_handler(self) -> ChunkOffloadHandler | None:
        """The handler of the chunk whose forward runs on the calling thread (chunks are per thread), if any."""
        handler = self._chunk_local.handler  # a thread-local lookup: no call on the per-group path
        return handler if handler is self._current else None

    # ------------------------------------------------------------------ iteration scope
    def begin_iteration(self, *, offload: bool | None = None) -> None:
        """Open one optimizer step's forwards and backwards.

        ``offload=False`` makes this iteration a baseline: the same groups and bytes are
        tracked, nothing is copied (None: `OffloadConfig.offload`).
        """
        check_begin_iteration(closed=self._closed, in_iteration=self.in_iteration, offload=offload)
        self._threads.claim()
        self.tensor_filter.refresh()
        self.schedule_policy.begin_iteration()
        offload = self.config.offload if offload is None else offload
        self._window = IterationWindow(self.streams, self.config, self._resident, self._stats, offload=offload)

    def end_iteration(self, *, discard: bool = False) -> IterationRecord | None:
        """Close the open iteration and return its record (also kept in `last_iteration`).

        ``discard=True`` (an exception, or a step given up): every chunk of it is discarded
        now (its saved tensors can no longer be unpacked) and no record is made (None). After
        `close` (which ended the iteration) it returns None.
        """
        check_flag("end_iteration", "discard", discard)
        if self._closed and not self.in_iteration:
            return None
        if not self.in_iteration:
            raise ChunkOffloadError("end_iteration() without an open iteration; call begin_iteration() first.")
        window = self._window
        try:
            if discard:
                window.discard()
                return None
            try:
                record = window.finish()
            except BaseException:
                window.discard()
                raise
            self.last_iteration = record
            return record
        finally:
            self._window = None
            self._live_handlers = let_go_of_released((*self._live_handlers, *window.handlers))  # NOTE [No cycles per iteration]

    @contextlib.contextmanager
    def iteration(self, *, offload: bool | None = None) -> Iterator["OffloadManager"]:
        """`begin_iteration` ... `end_iteration` as a ``with`` block; an exception discards the iteration."""
        self.begin_iteration(offload=offload)
        try:
            yield self
        except BaseException:
            if self.in_iteration:  # `close` inside the block already discarded it
                run_cleanup(functools.partial(self.end_iteration, discard=True), "discarding the iteration")
            raise
        if self.in_iteration:
            self.end_iteration()

    def group_bytes(self) -> dict[tuple[int, int], list[int]]:
        """(microbatch, vp_stage) -> saved bytes per group, in forward order, of the last iteration."""
        return dict(self.last_iteration.group_bytes) if self.last_iteration is not None else {}

    def regroup(self, layer_group_bytes: int | None) -> None:
        """Bound layer groups at ``layer_group_bytes`` from the next iteration on (`OffloadConfig`'s
        field; 0: no call joins but registered joiners). Between iterations, under layer groups
        (NOTE [Budget splits layer groups] in integrations/layer_split.py lowers it)."""
        self.config = checked_regroup(self.config, layer_group_bytes, in_iteration=self.in_iteration)
        self._ctx.layer_group_bytes = self.config.layer_group_bytes

    # ------------------------------------------------------------------ chunk scope
    def begin_chunk(self, *, microbatch: int, vp_stage: int = 0) -> ChunkOffloadHandler | None:
        """Open the forward of one microbatch through one model chunk (virtual stage) of this rank.

        Returns the chunk's handler; under ``torch.no_grad()`` or inference mode nothing is
        tracked and None is returned. Every `begin_chunk` needs its `end_chunk`.
        """
        open_key, open_here = None if self._current is None else self._current.key, self.current_handler is not None
        check_begin_chunk(microbatch, vp_stage, in_iteration=self.in_iteration, open_key=open_key, open_here=open_here)
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            self._untracked_chunks += 1
            return None
        handler = self._window.open_chunk(self._ctx, self.schedule_policy, ChunkKey(microbatch, vp_stage))
        self._current = handler
        self._chunk_local.handler = handler
        return handler

    def end_chunk(self, *, abort: bool = False) -> ChunkOffloadHandler | None:
        """Close the chunk `begin_chunk` opened: release its groups' device tensors. ``abort=True`` (its
        forward raised): discard the chunk's groups instead. Returns the chunk's handler (None for a
        chunk that tracked nothing, or after `close`, which aborted it)."""
        check_flag("end_chunk", "abort", abort)
        handler = self._current
        if handler is not None and self.current_handler is None:
            raise ChunkOffloadError(f"end_chunk() on another thread than the one that began chunk {handler.key}; end it there.")
        if handler is None:
            if self._closed:
                return None
            if self._untracked_chunks == 0:
                raise ChunkOffloadError("end_chunk() without an open chunk; call begin_chunk() first.")
            self._untracked_chunks -= 1
            return None
        return self._finish_chunk(handler, abort=abort)

    def _finish_chunk(self, handler: ChunkOffloadHandler, *, abort: bool) -> ChunkOffloadHandler:
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
            self._chunk_local.handler = None  # on another thread (close) a stale one no longer matches `_current`
        return handler

    @contextlib.contextmanager
    def chunk(self, *, microbatch: int, vp_stage: int = 0) -> Iterator[ChunkOffloadHandler | None]:
        """`begin_chunk` ... `end_chunk` as a ``with`` block; an exception aborts the chunk. After `close`
        inside the block (which aborted the chunk) the block exits quietly, or with its own exception."""
        handler = self.begin_chunk(microbatch=microbatch, vp_stage=vp_stage)
        try:
            yield handler
        except BaseException:
            if not self._closed:
                run_cleanup(functools.partial(self.end_chunk, abort=True), "aborting the chunk")
            raise
        if not self._closed:
            self.end_chunk()

    def _on_backward_start(self, handler: ChunkOffloadHandler) -> None:
        if self.in_iteration:  # a backward after its iteration ended (outside any) is not recorded
            self._window.note_action(Action(ActionKind.BACKWARD, handler.key.microbatch, handler.key.vp_stage))
            self._window.prefetch(self.schedule_policy.prefetch_on("B", handler.key))

    # ------------------------------------------------------------------ low-level marks
    def group_start(self, tensors: Any, name: str) -> Any:
        """Open group ``name`` on ``tensors`` (a tensor or a tuple/list of them); returns them.

        Until `group_commit`, what autograd saves goes to the group. Outside a chunk, or with
        gradients disabled, this returns ``tensors`` unchanged. A ``tensors`` without a tensor or a
        ``name`` that is not a str is refused here, in or out of a chunk.
        """
        check_group_args("group_start", tensors, name)
        return self._marks.start(self.current_handler, tensors, name)

    def group_commit(self, tensors: Any, name: str) -> Any:
        """Commit group ``name`` on its outputs ``tensors`` and start its offload; returns them."""
        check_group_args("group_commit", tensors, name)
        return self._marks.commit(self.current_handler, tensors, name)

    # ------------------------------------------------------------------ results
    def stats(self) -> OffloadStats:
        """Counters per group name and the resident-bytes high-water mark (waits for copies). Safe from
        any thread while iterations run (a monitor): there it waits only for the copies whose times it
        adds, and each part (counters, resident bytes and their marks, pool) is read at one moment."""
        self._fold_stats()
        return OffloadStats.collect(self._stats, self._resident, self.pool.stats())

    def reset_stats(self) -> None:
        """Zero the per-name counters and restart the high-water mark from now."""
        self._fold_stats()
        self._stats.clear()
        self._resident.reset_peak()

    def _fold_stats(self) -> None:
        if not self._closed and self._threads.on_owner():  # closed: the copies are done, the workers gone
            self.streams.synchronize()  # only on the training thread: the streams are not thread-safe
        self._stats.fold()

    def live_chunks(self) -> list[ChunkKey]:
        """Chunks whose saved tensors are still held (their backward has not consumed them all)."""
        handlers = (*self._live_handlers, *self.iteration_handlers)
        return [h.key for h in handlers if not h.released]

    def close(self) -> None:
        """Wait for the copies, stop the stream workers, remove every module's hooks and release the
        host pool's buffers (idempotent): a manager kept after `close` holds no model and no host memory.

        Inside an open iteration, its open chunk is aborted and the iteration discarded first
        (no saved-tensor hook and no host buffer stays), so an enclosing ``with`` block exits
        quietly or re-raises its own exception, which a failure of close never replaces
        (`run_cleanup`). Only the thread that began an open iteration may close the manager.
        """
        if self._closed:
            return
        if self.in_iteration:
            self._threads.require_owner("close()", "call close() on that thread (e.g. after its iteration ends)")
        run_cleanup(self._close, "close()")

    def _close(self) -> None:
        try:
            if self._current is not None:
                self._finish_chunk(self._current, abort=True)
            if self.in_iteration:
                self.end_iteration(discard=True)
        finally:
            self._closed = True
            self.tensor_filter.forget_protected()
            self._registry.remove_all()
            self.streams.synchronize()
            self.streams.close()
            self.pool.trim()  # NOTE [Releasing host memory] in host_buffer.py: back to torch's pinned cache
