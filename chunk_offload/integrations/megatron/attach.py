"""`attach`: offload chosen submodules of megatron-core GPTModel chunks under Megatron's schedules.

Nothing in Megatron is patched. Module hooks do all the work:

- each offloaded submodule (see `modules.py`) becomes one group per call;
- each model chunk's forward opens the chunk handler for (microbatch, vp_stage) (`chunk_hooks.py`):
  Megatron's schedules run the forwards of one model chunk in microbatch order, so the microbatch
  is the number of forwards that chunk already ran in this iteration;
- `MegatronOffloadManager.wrap(forward_backward_func)` makes each training call one iteration;
- or, with ``iterations="auto"`` (for loops that call ``get_forward_backward_func()`` themselves,
  like Megatron-LM's ``pretrain``), the chunk hooks open and close the iterations (`auto.py`).

A forward-only pass (a ``forward_only=True`` call, or any forward under ``torch.no_grad()`` or
inference mode, or inside `MegatronOffloadManager.forward_only`) offloads nothing and leaves the
training state untouched (NOTE [Forward-only passes] in ``session.py``).

A training forward (gradients enabled) outside any iteration offloads nothing; the hooks then
warn once, naming both ways to open iterations.

The rank's plan comes from Megatron's own schedule tables (`chunk_offload.schedule.megatron_plan`)
at the first training call, and drives a `PlanPolicy` by default: chunks whose backward follows
at once copy all but their last groups once an iteration measured them (NOTE [Kept tail]), and
the next backward chunk is reloaded during the action before it.
The order in which chunks really ran is recorded per iteration (`observed_order`) and checked
against the plan after every iteration: on a difference a warning shows both, and the observed
order becomes the plan.

``baseline_iterations=N`` runs the first N training calls without copies (identical
accounting); their `IterationRecord` and the last offloaded one are kept in `records`, from
which `report` builds the rank's per-stage report. What runs between iterations (records, the
plan check, the budgets, the schedule policy) is the `TrainingSession`'s (``session.py``).

The auto-iteration state machine is `auto.AutoIterations` (NOTE [Automatic iterations] there).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable, Iterator, Literal, Sequence

from torch import nn

from ...core import Action, ChunkOffloadError, OffloadConfig, SchedulePolicy, StreamBackend
from ...report import StageReport
from ...schedule import megatron_plan
from ..attached import AttachedManager, ScheduleOptions, alive
from ..plan_tracking import PlanTracking
from ..session import TrainingSession, check_baseline_iterations
from .auto import AutoIterations, check_iterations
from .chunk_hooks import ChunkHooks
from ...module_names import check_combination
from .modules import canonical_names, check_model_support, offload_submodules
from .reporting import build_stage_report

__all__ = ["MegatronOffloadManager", "attach"]


class MegatronOffloadManager(AttachedManager):
    """An offload engine (``engine``, an `OffloadManager`) bound to the model chunks of one pipeline rank.

    ``iterations``: ``"wrap"`` (default): each call of ``manager.wrap(get_forward_backward_func())``
    is one iteration. ``"auto"``: the chunk hooks open and close iterations themselves, for
    training loops that call ``get_forward_backward_func()`` themselves (Megatron-LM's
    ``pretrain``); ``num_microbatches`` (an int, or a callable returning the current count; None:
    Megatron's ``get_num_microbatches()``) is the forwards per chunk in one iteration. See NOTE
    [Automatic iterations] in ``auto.py``. ``options``: the schedule and budget keywords of
    `attach` (`ScheduleOptions`; None: the defaults).
    """

    def __init__(
        self,
        model_chunks: nn.Module | Sequence[nn.Module],
        offload_modules: str | Sequence[str],
        *,
        config: OffloadConfig | None = None,
        streams: StreamBackend | None = None,
        options: ScheduleOptions | None = None,
        baseline_iterations: int = 0,
        iterations: Literal["wrap", "auto"] = "wrap",
        num_microbatches: int | Callable[[], int] | None = None,
    ) -> None:
        offload_modules = canonical_names(offload_modules)  # fail before the streams start
        options = options if options is not None else ScheduleOptions()
        PlanTracking(options)
        check_baseline_iterations(baseline_iterations)
        check_iterations(iterations, num_microbatches)
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
            raise ChunkOffloadError(
                f"attach expects a GPTModel chunk or a list of them (one per virtual stage), got {model_chunks!r:.200}"
            )
        check_combination(offload_modules, _recomputed(chunks[0]), modules_flag="offload_modules", recompute_flag="config.recompute_modules")
        check_model_support(chunks, offload_modules)  # e.g. fused_group_mlp needs op-fuser experts
        # NOTE [Deferred exchanges] (exchange.py): auto iterations close where ranks wait on each other.
        session = TrainingSession(
            config=config,
            streams=streams,
            options=options,
            check_order=self._check_plan,
            baseline_iterations=baseline_iterations,
            pipeline_group=_pipeline_group() if options.device_budget_bytes == "auto" else None,
            blocking_exchanges=iterations == "wrap",
        )
        super().__init__(session)
        self._plan_key: tuple | None = None
        self._chunks = [weakref.ref(chunk) for chunk in chunks]
        self.offload_modules = offload_modules
        self.registered: dict[str, int] = offload_submodules(self.engine, chunks, offload_modules)
        """Offload-module name -> submodules registered on this rank (a name matching none is left out)."""
        self.iterations = iterations
        """``"wrap"`` or ``"auto"``: who opens and closes the training iterations (`ITERATION_MODES`)."""
        self._auto = AutoIterations(self, num_microbatches) if iterations == "auto" else None
        self._hooks = ChunkHooks(self.session, chunks, self._auto)

    @property
    def model_chunks(self) -> list[nn.Module]:
        """The model chunks it is attached to, held weakly (`alive`): a manager kept after its model is
        dropped (a list of results, a notebook variable) keeps no model alive."""
        return alive(self._chunks)

    @property
    def forwards(self) -> list[int]:
        """Training forwards each model chunk ran in the open iteration (the next one's microbatch)."""
        return self._hooks.forwards

    # ------------------------------------------------------------------ iterations
    def iteration(self, *, offload: bool | None = None) -> contextlib.AbstractContextManager["MegatronOffloadManager"]:
        """One training iteration (`OffloadManager.iteration`); each chunk counts its forwards from microbatch 0 again."""
        if self.iterations == "auto":
            raise ChunkOffloadError(
                "iteration() on a manager attached with iterations='auto', which opens and closes its iterations "
                "itself; run the training steps without it, or attach with iterations='wrap'."
            )
        return self._iteration_scope(offload=offload)

    @contextlib.contextmanager
    def _iteration_scope(self, *, offload: bool | None) -> Iterator["MegatronOffloadManager"]:
        with self.session.iteration(offload=offload):
            self._hooks.new_iteration()  # after the nesting checks
            yield self

    def begin_training_iteration(self) -> None:
        """Open the engine's iteration for the next training call (a baseline while baseline iterations remain)."""
        self.session.begin_iteration()
        self._hooks.new_iteration()

    def end_training_iteration(self, *, discard: bool = False) -> None:
        """Close the engine's iteration; unless discarded, count the training call, keep its record, check the plan."""
        self.session.end_iteration(discard=discard)

    def wrap(self, forward_backward_func: Callable) -> Callable:
        """Return ``forward_backward_func`` with each training call run as one offload iteration."""
        if self.iterations == "auto":
            raise ChunkOffloadError(
                "wrap() on a manager attached with iterations='auto', which opens an iteration at the first training "
                "chunk forward of each step by itself; call get_forward_backward_func() unwrapped, or attach with "
                "iterations='wrap' to delimit iterations by the wrapped calls."
            )

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not self.session.is_training_pass(forward_only=kwargs.get("forward_only", False)):
                with self.session.forward_only():  # NOTE [Forward-only passes]
                    return forward_backward_func(*args, **kwargs)
            self.prepare_plan(kwargs.get("num_microbatches"))
            with self.session.training_iteration():
                self._hooks.new_iteration()
                return forward_backward_func(*args, **kwargs)

        wrapped.__wrapped__ = forward_backward_func
        return wrapped

    def forward_only(self) -> contextlib.AbstractContextManager[None]:
        """A forward-only pass, even with gradients enabled: its chunk forwards offload nothing and
        leave the training state untouched (NOTE [Forward-only passes] in ``session.py``).

        Needed only for a ``forward_only=True`` call with gradients enabled that does not go
        through `wrap` (with ``iterations="auto"`` it would look like training); ``torch.no_grad()``
        and inference mode need no scope.
        """
        return self.session.forward_only()

    def end_iteration(self, *, discard: bool = False) -> None:
        """Close the iteration that ``iterations="auto"`` opened, now instead of at the next chunk forward.

        Raises `ChunkOffloadError` if it is not complete (some forwards or backwards of the step
        have not run), unless ``discard=True``: then its chunks are dropped without a record or
        a training call (their saved tensors can no longer be used). No-op when none is open.
        """
        if self._auto is None:
            raise ChunkOffloadError(
                "end_iteration() is for managers attached with iterations='auto'; with iterations='wrap' each call of "
                "the wrapped forward_backward_func is one iteration and ends with the call."
            )
        self._auto.end_iteration(discard=discard)

    # ------------------------------------------------------------------ plan
    def prepare_plan(self, num_microbatches: int | None) -> None:
        """Build this rank's plan from Megatron's tables (once per microbatch count)."""
        if num_microbatches is None:
            raise ChunkOffloadError("the wrapped forward_backward_func must be called with num_microbatches=... (keyword)")
        from megatron.core import parallel_state

        chunks = self.model_chunks
        if len(chunks) != len(self._chunks):
            raise ChunkOffloadError("the model chunks this manager was attached to were freed; attach the new model instead")
        config = getattr(chunks[0], "config", None)
        vp = len(chunks) if len(chunks) > 1 else None
        key = (
            num_microbatches,
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_rank(),
            vp,
            getattr(config, "microbatch_group_size_per_vp_stage", None),
        )
        if key == self._plan_key:
            return
        self._plan_key = key
        self.session.use_plan(
            megatron_plan(
                num_microbatches=key[0], pp_size=key[1], pp_rank=key[2], vp_size=key[3], microbatch_group_size_per_vp_stage=key[4]
            )
        )

    def _check_plan(self, observed_order: Sequence[Action]) -> None:
        """After an iteration: the order that ran must be the plan; if not, the observed order wins."""
        plan = self.plan
        difference = self.tracking.diff(observed_order)
        if difference is None:
            return
        try:
            observed = PlanTracking.observed_plan(observed_order, pp_rank=plan.pp_rank, pp_size=plan.pp_size, vp_size=plan.vp_size)
        except ChunkOffloadError as e:
            observed = None
            difference += f"\nThe observed order is not a complete plan either ({e}); schedule decisions are off."
        warnings.warn(
            f"chunk_offload: the schedule that ran differs from Megatron's table; using the observed order. {difference}",
            RuntimeWarning,
            stacklevel=3,
        )
        self.session.use_plan(observed)

    def report(self) -> StageReport:
        """This rank's per-stage report: the first baseline iteration against the last offloaded one.

        Needs ``baseline_iterations >= 1`` and one offloaded training call after them. Gather
        the ranks' reports explicitly with `chunk_offload.report.gather_reports`. In auto mode the
        open iteration is closed first (`end_iteration`: it must be complete).
        """
        if self._auto is not None:
            self.end_iteration()
        return build_stage_report(self.session)

    def close(self) -> None:
        """`OffloadManager.close`; in auto mode first close the open iteration (discarded, with a warning, if incomplete)."""
        if not self.engine.closed and self._auto is not None:
            self._auto.settle(discard_incomplete=True)
        self.engine.close()

    def detach(self) -> None:
        """Remove every hook this manager installed on the model (in auto mode: closing a complete open iteration first)."""
        if self._auto is not None:
            self._auto.settle(discard_incomplete=False)
        self._hooks.remove()
        self._remove_module_offloads()


def _recomputed(chunk: nn.Module) -> list[str]:
    """The modules megatron-core's selective recompute covers in ``chunk`` (its TransformerConfig)."""
    config = getattr(chunk, "config", None)
    if getattr(config, "recompute_granularity", None) != "selective":
        return []
    return list(getattr(config, "recompute_modules", None) or [])


def _pipeline_group() -> Any:
    """Megatron's pipeline group of this rank (None before model parallelism is initialized)."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None


def attach(
    model_chunks: nn.Module | Sequence[nn.Module],
    offload_modules: str | Sequence[str],
    *,
    config: OffloadConfig | None = None,
    streams: StreamBackend | None = None,
    schedule_policy: SchedulePolicy | Literal["plan"] | None = "plan",
    prefetch_bytes: int | None = None,
    reload_ahead_bytes: int | None = None,
    device_budget_bytes: int | Literal["auto"] | None = None,
    host_budget_bytes: int | None = None,
    timed_reload_ahead: bool | Literal["auto"] = "auto",
    baseline_iterations: int = 0,
    iterations: Literal["wrap", "auto"] = "wrap",
    num_microbatches: int | Callable[[], int] | None = None,
) -> MegatronOffloadManager:
    """Offload ``offload_modules`` of megatron-core GPTModel ``model_chunks`` (one per virtual stage).

    ``offload_modules``: names from `chunk_offload.integrations.megatron.OFFLOAD_MODULE_NAMES`
    (a list or a comma-separated string). ``config``: the engine's `OffloadConfig`.
    ``schedule_policy``, ``prefetch_bytes``, ``reload_ahead_bytes``, ``device_budget_bytes``
    (bytes or ``"auto"``), ``host_budget_bytes`` (the node's pinned host bytes) and
    ``timed_reload_ahead`` are `ScheduleOptions`' (NOTEs [Device budget] and [Node host budget] in ``integrations/budgets.py``;
    with ``"auto"`` or a host budget, attaching is a collective: every rank attaches). The other
    keywords are `MegatronOffloadManager`'s. Wrap Megatron's ``get_forward_backward_func()`` with
    the returned manager's `wrap`, or pass ``iterations="auto"`` when the training loop calls it
    itself (Megatron-LM's ``pretrain``).
    """
    return MegatronOffloadManager(
        model_chunks,
        offload_modules,
        config=config,
        streams=streams,
        options=ScheduleOptions(
            schedule_policy=schedule_policy,
            prefetch_bytes=prefetch_bytes,
            reload_ahead_bytes=reload_ahead_bytes,
            device_budget_bytes=device_budget_bytes,
            host_budget_bytes=host_budget_bytes,
            timed_reload_ahead=timed_reload_ahead,
        ),
        baseline_iterations=baseline_iterations,
        iterations=iterations,
        num_microbatches=num_microbatches,
    )
