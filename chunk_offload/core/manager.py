"""`OffloadManager`: the one object a training run creates to offload activations.

It owns the streams, the host pool, the policy, the chunk handlers of the current
iteration and the statistics. There is no global instance: each manager is explicit, and
the chunk being run is the manager's own scoped state, restored on exit.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator, Literal, Sequence

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from .errors import ChunkOffloadError
from .functions import build_group_functions
from .group import WAIT_NAMES, EngineContext
from .handler import ChunkKey, ChunkOffloadHandler
from .host_pool import HostPool
from .policy import OffloadPolicy
from .schedule_policy import SchedulePolicy
from .stats import GroupStats, IterationRecord, OffloadStats, ResidentBytes, StatsRecorder
from .streams import StreamBackend, default_streams

__all__ = ["OffloadConfig", "OffloadManager"]


@dataclass(kw_only=True, slots=True)
class OffloadConfig:
    """Options of an `OffloadManager`."""

    min_offload_bytes: int = 1 << 20
    """Saved tensors smaller than this stay on device (copies of small tensors cost more than they save)."""
    host_pool_bytes: int | None = None
    """Cap on the host memory of the pool; ``None`` for no cap."""
    on_exhausted: Literal["fallback", "error"] = "fallback"
    """At the cap: allocate unpooled host buffers with one warning, or raise."""
    offload: bool = True
    """False: track groups and resident bytes but copy nothing (a baseline with identical accounting)."""
    measure_time: bool = True
    """Time copies and compute waits (CUDA events on GPU); `stats` reports them."""
    trace: bool = False
    """Record the resident saved bytes (and on CUDA the allocated device memory) after every
    accounting change of an iteration, in `IterationRecord.resident_trace` / ``device_trace``."""

    def validate(self) -> None:
        if not isinstance(self.min_offload_bytes, int) or self.min_offload_bytes < 0:
            raise ChunkOffloadError(f"min_offload_bytes must be an int >= 0, got {self.min_offload_bytes!r}")
        for name in ("offload", "measure_time", "trace"):
            if not isinstance(getattr(self, name), bool):
                raise ChunkOffloadError(f"{name} must be True or False, got {getattr(self, name)!r}")


class OffloadManager:
    """Offloads what chosen submodules save for backward, per (microbatch, virtual stage) chunk.

    Example::

        mgr = OffloadManager(min_offload_bytes=1 << 20)
        mgr.offload_module(layer.self_attention.core_attention, "core_attn")
        with mgr.iteration():
            with mgr.chunk(microbatch=0, vp_stage=0):
                loss = model(x)
            loss.backward()

    Args:
        streams: the stream backend; default CUDA streams when CUDA is available, else CPU
            worker-thread streams.
        schedule_policy: which chunks to offload and what to reload ahead, from the pipeline
            schedule (`chunk_offload.schedule.PlanPolicy`); default offload every chunk and
            reload one group ahead in backward.
        **options: fields of `OffloadConfig`.
    """

    def __init__(
        self,
        *,
        streams: StreamBackend | None = None,
        schedule_policy: SchedulePolicy | None = None,
        _test_skip_waits: Sequence[str] = (),
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - set(OffloadConfig.__slots__))
        if unknown:
            raise ChunkOffloadError(f"unknown OffloadManager options {unknown}; valid: {sorted(OffloadConfig.__slots__)}")
        bad_waits = sorted(set(_test_skip_waits) - set(WAIT_NAMES))
        if bad_waits:
            raise ChunkOffloadError(f"unknown wait names {bad_waits}; valid: {list(WAIT_NAMES)}")
        self.config = OffloadConfig(**options)
        self.config.validate()
        self.streams = streams if streams is not None else default_streams()
        self.pool = HostPool(
            capacity_bytes=self.config.host_pool_bytes,
            pin_memory=self.streams.pin_memory,
            on_exhausted=self.config.on_exhausted,
        )
        if schedule_policy is not None and not isinstance(schedule_policy, SchedulePolicy):
            raise ChunkOffloadError(
                f"schedule_policy must be a chunk_offload SchedulePolicy (e.g. chunk_offload.schedule.PlanPolicy), "
                f"got {type(schedule_policy).__name__}"
            )
        self.schedule_policy = schedule_policy if schedule_policy is not None else SchedulePolicy()
        self.policy = OffloadPolicy(min_offload_bytes=self.config.min_offload_bytes, device_type=self.streams.device.type)
        self._resident = ResidentBytes()
        self._stats = StatsRecorder()
        self._ctx = EngineContext(
            streams=self.streams,
            pool=self.pool,
            should_offload=self.policy.should_offload,
            resident=self._resident,
            stats=self._stats,
            on_backward_start=self._on_backward_start,
            measure_time=self.config.measure_time,
            skip_waits=frozenset(_test_skip_waits),
        )
        self._functions = build_group_functions()
        self._in_iteration = False
        self._current: ChunkOffloadHandler | None = None
        self._hooks_pushed: list[saved_tensors_hooks] = []
        self._iteration_handlers: list[ChunkOffloadHandler] = []
        self._live_handlers: list[ChunkOffloadHandler] = []
        self._closed = False
        self._registrations: list[ModuleOffload] = []
        self._iteration_offload = self.config.offload
        self._by_key: dict[ChunkKey, ChunkOffloadHandler] = {}
        self._order: list[tuple[str, int, int]] = []
        self.last_iteration: IterationRecord | None = None
        """What the last iteration that completed did (peaks, traces, bytes per group)."""

    # ------------------------------------------------------------------ registration
    def offload_module(self, module: nn.Module, name: str) -> "ModuleOffload":
        """Offload, as one group named ``name``, what each call of ``module`` saves for backward.

        The module's own parameters and buffers are protected. Returns a handle whose
        ``remove()`` undoes the registration.
        """
        if not isinstance(module, nn.Module):
            raise ChunkOffloadError(f"offload_module expects an nn.Module, got {type(module).__name__}")
        if not isinstance(name, str) or not name:
            raise ChunkOffloadError(f"offload_module needs a non-empty group name, got {name!r}")
        self.policy.protect(module)
        registration = ModuleOffload(self, module, name)
        self._registrations.append(registration)
        return registration

    def protect_module(self, module: nn.Module) -> None:
        """Never offload parameters or buffers of ``module`` (or views of their storage)."""
        self.policy.protect(module)

    # ------------------------------------------------------------------ scopes
    @contextlib.contextmanager
    def iteration(self, *, offload: bool | None = None) -> Iterator["OffloadManager"]:
        """One optimizer step's forwards and backwards. On an exception, every chunk is discarded.

        ``offload=False`` makes this iteration a baseline: the same groups and bytes are
        tracked, nothing is copied (None: `OffloadConfig.offload`). When it completes,
        `last_iteration` describes it.
        """
        if self._closed:
            raise ChunkOffloadError("iteration() on a closed OffloadManager; create a new manager.")
        if self._in_iteration:
            raise ChunkOffloadError("iteration() entered while an iteration is already open; they cannot nest.")
        if offload is not None and not isinstance(offload, bool):
            raise ChunkOffloadError(f"iteration(offload=...) takes True, False or None, got {offload!r}")
        self.policy.refresh()
        self._iteration_offload = self.config.offload if offload is None else offload
        self.schedule_policy.begin_iteration()
        self._in_iteration = True
        self._iteration_handlers = []
        self._by_key = {}
        self._order = []
        start = self._start_record()
        try:
            yield self
            self.last_iteration = self._finish_record(*start)
        except BaseException:
            for handler in self._iteration_handlers:
                handler.abort()
            raise
        finally:
            self._in_iteration = False
            self._live_handlers = [h for h in (*self._live_handlers, *self._iteration_handlers) if not h.released]
            self._iteration_handlers = []
            self._by_key = {}

    def _start_record(self) -> tuple[dict[str, GroupStats], float]:
        cuda = self.streams.device.type == "cuda"
        if cuda:
            # The allocator's statistics are kept on the host at allocation time: no device sync
            # is needed for them; the wall time (measure_time) needs one at both ends.
            if self.config.measure_time:
                torch.cuda.synchronize(self.streams.device)
            torch.cuda.reset_peak_memory_stats(self.streams.device)
        device_bytes = (lambda: torch.cuda.memory_allocated(self.streams.device)) if cuda else None
        self._resident.start_window(trace=self.config.trace, device_bytes=device_bytes)
        self.streams.synchronize()
        self._stats.fold()
        return {name: replace(g) for name, g in self._stats.groups.items()}, time.perf_counter()

    def _finish_record(self, before: dict[str, GroupStats], started: float) -> IterationRecord:
        cuda = self.streams.device.type == "cuda"
        self.streams.synchronize()
        if cuda and self.config.measure_time:
            torch.cuda.synchronize(self.streams.device)
        wall = time.perf_counter() - started
        self._stats.fold()
        groups = {}
        for name, now in self._stats.groups.items():
            was = before.get(name, GroupStats())
            groups[name] = GroupStats(**{f: getattr(now, f) - getattr(was, f) for f in GroupStats.__dataclass_fields__})
        window = self._resident.window
        return IterationRecord(
            offload=self._iteration_offload,
            peak_resident_bytes=window.peak,
            peak_saved_bytes=window.saved_peak,
            host_bytes_at_saved_peak=window.host_at_saved_peak,
            device_peak_bytes=torch.cuda.max_memory_allocated(self.streams.device) if cuda else None,
            resident_trace=self._resident.trace,
            device_trace=self._resident.device_trace,
            group_bytes={tuple(h.key): h.group_bytes() for h in self._iteration_handlers},
            groups=groups,
            order=list(self._order),
            wall_time_s=wall,
        )

    def group_bytes(self) -> dict[tuple[int, int], list[int]]:
        """(microbatch, vp_stage) -> saved bytes per group, in forward order, of the last iteration."""
        return dict(self.last_iteration.group_bytes) if self.last_iteration is not None else {}

    @contextlib.contextmanager
    def chunk(self, *, microbatch: int, vp_stage: int = 0) -> Iterator[ChunkOffloadHandler | None]:
        """The forward of one microbatch through one model chunk (virtual stage) of this rank.

        Under ``torch.no_grad()`` or inference mode nothing is tracked and None is yielded.
        """
        if not self._in_iteration:
            raise ChunkOffloadError("chunk() must be used inside `with manager.iteration():`.")
        if self._current is not None:
            raise ChunkOffloadError(
                f"chunk(microbatch={microbatch}, vp_stage={vp_stage}) entered inside chunk {self._current.key}; "
                "chunks cannot nest."
            )
        for label, value in (("microbatch", microbatch), ("vp_stage", vp_stage)):
            if not isinstance(value, int) or value < 0:
                raise ChunkOffloadError(f"chunk() needs {label} as an int >= 0, got {value!r}")
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            yield None
            return
        key = ChunkKey(microbatch, vp_stage)
        self._order.append(("F", microbatch, vp_stage))
        self._prefetch(self.schedule_policy.prefetch_on("F", key))
        offload = self._iteration_offload and self.schedule_policy.offload_chunk(key)
        handler = ChunkOffloadHandler(self._ctx, key, offload=offload, reload_ahead_bytes=self.schedule_policy.reload_ahead_bytes(key))
        self._by_key[key] = handler  # a chunk key entered twice (no schedule does that) maps to its latest forward
        self._iteration_handlers.append(handler)
        self._current = handler
        try:
            yield handler
            self._pop_hooks()
            handler.finish_forward()
        except BaseException:
            self._pop_hooks()
            handler.abort()
            raise
        finally:
            self._current = None

    def _on_backward_start(self, handler: ChunkOffloadHandler) -> None:
        self._order.append(("B", handler.key.microbatch, handler.key.vp_stage))
        if self._in_iteration:
            self._prefetch(self.schedule_policy.prefetch_on("B", handler.key))

    def _prefetch(self, requests) -> None:
        for key, budget in requests:
            handler = self._by_key.get(ChunkKey(*key))
            if handler is not None:  # a chunk that did not run forward (a plan that is wrong) is skipped
                handler.prefetch(budget)

    @property
    def current_handler(self) -> ChunkOffloadHandler | None:
        """The handler of the chunk whose forward is running, if any."""
        return self._current

    def _pop_hooks(self) -> None:
        while self._hooks_pushed:
            self._hooks_pushed.pop().__exit__(None, None, None)

    # ------------------------------------------------------------------ low-level marks
    def group_start(self, tensors: Any, name: str) -> Any:
        """Open group ``name`` on ``tensors`` (a tensor or a tuple/list of them); returns them.

        Until `group_commit`, what autograd saves goes to the group. Outside a chunk, or with
        gradients disabled, this returns ``tensors`` unchanged.
        """
        handler = self._current
        if handler is None or not torch.is_grad_enabled() or _foreign_saved_tensors_hooks(handler):
            return tensors
        flat, _ = _flatten(tensors)
        # A plain call, no autograd node on the inputs: see NOTE [No node on group inputs].
        group = handler.open_group(name)
        group.input_nodes = {node for t in flat if (node := t.grad_fn) is not None}
        group.activations = _leaf_activation_storages(flat)
        hooks = handler.saved_tensors_hooks
        hooks.__enter__()
        self._hooks_pushed.append(hooks)
        return tensors

    def group_commit(self, tensors: Any, name: str) -> Any:
        """Commit group ``name`` on its outputs ``tensors`` and start its offload; returns them."""
        handler = self._current
        if handler is None or not torch.is_grad_enabled():
            return tensors
        if handler.current is None and _foreign_saved_tensors_hooks(handler):
            return tensors  # group_start skipped it: another saved-tensor hook owns this region
        if handler.current is None or handler.current.name != name:
            handler.commit_group(name)  # raises the precise error
        self._hooks_pushed.pop().__exit__(None, None, None)
        flat, rebuild = _flatten(tensors)
        # Only outputs the group created pass through GroupCommit: a leaf (a parameter returned
        # as a bias) or an input handed back unchanged would have its gradient contributions
        # summed in another order (NOTE [No node on group inputs] in functions.py).
        inputs, handler.current.input_nodes = handler.current.input_nodes, set()  # no graph refs kept
        marked = [i for i, t in enumerate(flat) if t.grad_fn is not None and t.grad_fn not in inputs]
        out = list(flat)
        aliases = self._functions.commit.apply(handler, name, *(flat[i] for i in marked))
        for i, alias in zip(marked, aliases):
            out[i] = alias
        return rebuild(out)

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
        """Wait for the copies and stop the stream workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.streams.synchronize()
        self.streams.close()


class ModuleOffload:
    """The forward hooks that make each call of one module an offload group."""

    def __init__(self, manager: OffloadManager, module: nn.Module, name: str) -> None:
        self.manager = manager
        self.module = module
        self.name = name
        self._opened: list[bool] = []  # per nested call: did the pre-hook open a group?
        self._handles = [
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post, with_kwargs=True, always_call=True),
        ]

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        manager = self.manager
        handler = manager.current_handler
        if handler is None or not torch.is_grad_enabled() or _foreign_saved_tensors_hooks(handler):
            self._opened.append(False)
            return None
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        try:
            manager.group_start(inputs, self.name)
        except BaseException:
            self._opened.append(False)  # the always_call post hook runs next and must not commit
            raise
        self._opened.append(True)
        return None

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self._opened.pop():
            return None
        return self.manager.group_commit(output, self.name)

    def remove(self) -> None:
        """Remove the hooks; later calls of the module are not offloaded."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _leaf_activation_storages(tensors: list[torch.Tensor]) -> frozenset[int]:
    """Storages of group inputs that are plain leaves requiring grad (or views of one).

    Such an input is an activation handed to the group (a pipeline stage's received input, a
    detached chunk input), not a parameter, so the policy's leaf rule must not keep it.
    """
    storages = set()
    for t in tensors:
        root = t._base if t._base is not None else t
        if type(root) is torch.Tensor and root.is_leaf and root.requires_grad and t.layout == torch.strided:
            storages.add(t.untyped_storage().data_ptr())
    return frozenset(storages)


def _foreign_saved_tensors_hooks(handler: ChunkOffloadHandler) -> bool:
    """Whether saved-tensor hooks other than ``handler``'s own are active (a non-reentrant
    checkpoint region, ``save_on_cpu``, ...): a group opened there would take their tensors.
    ``handler``'s own hooks (a group still open) fall through to the nesting error."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and getattr(top[0], "__self__", None) is not handler


def _flatten(tensors: Any):
    """Tensors at the top level of ``tensors`` and a function that puts replacements back."""
    if isinstance(tensors, torch.Tensor):
        return [tensors], lambda out: out[0]
    if isinstance(tensors, (tuple, list)):
        positions = [i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor)]

        def rebuild(out):
            items = list(tensors)
            for i, t in zip(positions, out):
                items[i] = t
            return type(tensors)(items) if not hasattr(tensors, "_fields") else type(tensors)(*items)

        return [tensors[i] for i in positions], rebuild
    if tensors is None:
        return [], lambda out: None
    raise ChunkOffloadError(
        f"group marks take a tensor or a tuple/list of tensors, got {type(tensors).__name__}"
    )
