"""`attach`: offload chosen submodules of the stages of a torch.distributed.pipelining schedule.

Nothing in torch is edited. The attachment wraps methods on the *instances* it is given:

- ``schedule.step``: each training call is one `OffloadManager.iteration`; ``eval()`` and the
  steps of a schedule without a loss are forward-only passes, which copy nothing and leave the
  training state untouched (NOTE [Forward-only passes] in ``session.py``);
- each stage's ``forward_one_chunk(fwd_chunk_id, ...)``: the chunk scope of (microbatch
  ``fwd_chunk_id``, virtual stage = the stage's position among this rank's stages);
- each stage's ``backward_one_chunk`` / ``backward_weight_one_chunk``: record the plan's action
  of that call, ``B`` or ``W`` (`order.backward_call_kind`, NOTE [Zero-bubble weight steps] in
  ``order.py``: on the first stage the input-gradient call is none and the weight call is ``B``).

The offloaded submodules get the core's module hooks (`OffloadManager.offload_module`). The
wrappers only translate these events into `TrainingSession` calls; what runs between iterations
(the order check below, the budgets, the schedule policy) is the session's (``session.py``).

NOTE [Observed order wins]
The plan is first read from the schedule's own lists (`order.listed_plan`). Those lists are
not always what runs: torch 2.13's `Schedule1F1B` executes its hand-written loop, and its list
for the last rank names forwards 1..m instead of 0..m-1. So the first training iteration
records the order the stage methods were really called in; if it differs from the listed plan
(or the list is not a valid plan), a warning shows the difference and the observed order
becomes `PipelineOffloadManager.plan`.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any, Callable, Literal, Mapping, Sequence

from ...core import Action, ChunkOffloadError, OffloadConfig, SchedulePolicy, StreamBackend, diff_actions
from ...schedule import Plan
from ..attached import AttachedManager, ScheduleOptions, alive
from ..plan_tracking import PlanTracking
from ..session import TrainingSession
from . import order, selection
from .selection import ModuleSelector

__all__ = ["PipelineOffloadManager", "attach"]

logger = logging.getLogger(__name__)

_MARK = "__chunk_offload_pipelining__"
_MISSING = object()  # no instance attribute of that name before `_patch`


class PipelineOffloadManager(AttachedManager):
    """An offload engine (``engine``, an `OffloadManager`) bound to the stages of one rank of a pipelining schedule.

    Attributes:
        schedule: the schedule it is attached to (None once freed: the manager holds it and its
            stages weakly, so that a manager kept after them keeps no model alive).
        stages: this rank's stages in stage order; ``stages[v]`` is virtual stage ``v``.
        listed_plan: the plan from the schedule's own list (None if it lists none or lists an
            invalid order; ``listed_error`` then says why).
        plan: `listed_plan` until the first training iteration, then the plan checked against
            the observed order (See NOTE [Observed order wins]).
        plan_mismatch: the difference the first iteration found, or None.
        observed_order: the actions of the last training iteration, as they ran.
        registered: offload-module name -> qualified names of the submodules it matched, per stage.

    ``options``: the schedule and budget keywords of `attach` (`ScheduleOptions`; None: the defaults).
    """

    def __init__(
        self,
        schedule: Any,
        offload_modules: Sequence[str] | Mapping[str, ModuleSelector],
        *,
        config: OffloadConfig | None = None,
        streams: StreamBackend | None = None,
        options: ScheduleOptions | None = None,
    ) -> None:
        options = options if options is not None else ScheduleOptions()
        PlanTracking(options)
        if not order.is_schedule(schedule):
            raise ChunkOffloadError(
                f"attach expects a torch.distributed.pipelining schedule (Schedule1F1B, ScheduleInterleaved1F1B, ...), "
                f"got {type(schedule).__name__}"
            )
        if getattr(schedule.step, _MARK, False):
            raise ChunkOffloadError(
                f"{type(schedule).__name__} already has an offload manager attached; call its detach() first"
            )
        stages = order.schedule_stages(schedule)
        selectors = selection.selectors(offload_modules)
        matches = selection.resolve(stages, selectors)  # fail before the streams start
        listed_actions, listed, listed_error = None, None, None
        try:
            listed_actions = order.listed_actions(schedule)
            listed = order.listed_plan(schedule)
        except ChunkOffloadError as e:
            listed_error = str(e).removeprefix("chunk_offload: ").split("\n")[0]
        # The stages' group is the pipeline ('auto' budgets gather over it); step() ends on every rank alike.
        super().__init__(
            TrainingSession(
                config=config, streams=streams, options=options, check_order=self._check_order, pipeline_group=getattr(stages[0], "group", None)
            )
        )
        self._schedule = weakref.ref(schedule)
        self._stages = [weakref.ref(stage) for stage in stages]
        self.listed_actions: list[Action] | None = listed_actions
        self.listed_plan: Plan | None = listed
        self.listed_error: str | None = listed_error
        self.plan_mismatch: str | None = None
        self.registered: dict[str, list[list[str]]] = {name: [] for name in selectors}
        self._checked = False
        self._patched: list[tuple[Any, str, Any]] = []
        for vp_stage, stage in enumerate(stages):
            self.engine.protect_module(stage.submod)
            for name in selectors:
                self.registered[name].append([qualified for qualified, _ in matches[vp_stage][name]])
                for qualified, module in matches[vp_stage][name]:
                    self.engine.offload_module(module, name, layer=selection.layer_of(stage.submod, qualified))
            self._patch(stage, "forward_one_chunk", self._wrap_forward(stage.forward_one_chunk, vp_stage))
            for method in ("backward_one_chunk", "backward_weight_one_chunk"):
                self._patch(stage, method, self._wrap_record(stage, method, vp_stage))
        self._patch(schedule, "step", self._wrap_step(schedule.step))
        if self.engine.config.group_by == "layer" and all(r.layer is None for r in self.engine.module_offloads):
            warnings.warn("chunk_offload: group_by='layer', but no offload module lies in a layer (an element of a Sequential, "
                          "ModuleList or ModuleDict of a stage's submod): each call is its own group", stacklevel=2)  # fmt: skip
        self.session.use_plan(listed)

    @property
    def schedule(self) -> Any:
        return self._schedule()

    @property
    def stages(self) -> list[Any]:
        return alive(self._stages)

    # ------------------------------------------------------------------ wrappers
    def _patch(self, obj: Any, name: str, wrapper: Callable) -> None:
        """Set ``wrapper`` as an instance attribute of ``obj`` (the class is left alone)."""
        self._patched.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, wrapper)

    def _wrap_step(self, step: Callable) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.engine.in_iteration:
                return step(*args, **kwargs)
            if not self.session.is_training_pass(forward_only=not order.schedule_has_backward(self.schedule)):
                with self.session.forward_only():  # NOTE [Forward-only passes]
                    return step(*args, **kwargs)
            with self.session.training_iteration():
                return step(*args, **kwargs)

        setattr(wrapped, _MARK, True)
        wrapped.__wrapped__ = step
        return wrapped

    def _wrap_forward(self, forward_one_chunk: Callable, vp_stage: int) -> Callable:
        def wrapped(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if not self.engine.in_iteration:
                return forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            with self.session.chunk(microbatch=fwd_chunk_id, vp_stage=vp_stage):
                return forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        wrapped.__wrapped__ = forward_one_chunk
        return wrapped

    def _wrap_record(self, stage: Any, name: str, vp_stage: int) -> Callable:
        method = getattr(stage, name)

        def wrapped(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            kind = order.backward_call_kind(stage, name, args, kwargs)  # See NOTE [Zero-bubble weight steps]
            if kind is not None:
                self.session.chunk_backward_started(microbatch=bwd_chunk_id, vp_stage=vp_stage, kind=kind)
            return method(bwd_chunk_id, *args, **kwargs)

        wrapped.__wrapped__ = method
        return wrapped

    # ------------------------------------------------------------------ plan check
    def _check_order(self, observed_order: Sequence[Action]) -> None:
        """After the first training iteration: compare the plan with what ran (NOTE [Observed order wins])."""
        if self._checked:
            return
        self._checked = True
        name, rank = type(self.schedule).__name__, order.schedule_rank(self.schedule)
        try:
            observed = PlanTracking.observed_plan(
                observed_order, pp_rank=rank, pp_size=int(self.stages[0].group_size), vp_size=len(self.stages)
            )
        except ChunkOffloadError as e:
            self.session.use_plan(None)
            message = f"the order {name} ran on rank {rank} is not a plan chunk_offload can use, so no plan is set: {e}"
            warnings.warn(f"chunk_offload: {message}", stacklevel=3)
            return
        self.plan_mismatch = self._difference(observed)
        if self.plan_mismatch is not None:
            message = f"{name} on rank {rank} did not run the order it lists; using the observed order. {self.plan_mismatch}"
            warnings.warn(f"chunk_offload: {message}", stacklevel=3)
            self.session.use_plan(observed)
        elif self.listed_plan is None:
            logger.info("chunk_offload: %s lists no order; using the observed one: %s", name, observed)
            self.session.use_plan(observed)
        # else: the listed plan is what ran; it stays (with its source).

    def _difference(self, observed: Plan) -> str | None:
        """How the schedule's list differs from ``observed``; None if equal or if it lists nothing."""
        if self.listed_plan is not None:
            return self.listed_plan.diff(observed.actions)
        if self.listed_error is None:
            return None
        if self.listed_actions is None:
            return f"its list cannot be read ({self.listed_error}); observed: {observed.format()}"
        difference = diff_actions(self.listed_actions, observed.actions, name="listed")
        return f"its list is not a valid plan ({self.listed_error}); {difference}"

    # ------------------------------------------------------------------ teardown
    def detach(self) -> None:
        """Restore the schedule's and stages' methods and remove the module hooks (idempotent)."""
        for obj, name, previous in reversed(self._patched):
            if previous is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, previous)
        self._patched = []
        self._remove_module_offloads()


def attach(
    schedule: Any,
    offload_modules: Sequence[str] | Mapping[str, ModuleSelector],
    *,
    config: OffloadConfig | None = None,
    streams: StreamBackend | None = None,
    schedule_policy: SchedulePolicy | Literal["plan"] | None = "plan",
    prefetch_bytes: int | None = None,
    reload_ahead_bytes: int | None = None,
    device_budget_bytes: int | Literal["auto"] | None = None,
    host_budget_bytes: int | None = None,
    timed_reload_ahead: bool | Literal["auto"] = "auto",
) -> PipelineOffloadManager:
    """Offload ``offload_modules`` of this rank's stages under ``schedule`` (a pipelining schedule).

    ``offload_modules``: fnmatch patterns over qualified submodule names of each stage's
    ``submod`` (each pattern is its own group name), or a mapping group name -> pattern(s) and/or
    nn.Module classes, e.g. ``{"attn": "layers.*.attention", "norm": nn.LayerNorm}``.
    ``config``: the engine's `OffloadConfig`; the other keywords are `PipelineOffloadManager`'s:
    ``device_budget_bytes`` (bytes or ``"auto"``, over the stages' group) and ``host_budget_bytes``
    (the node's pinned host bytes) are `ScheduleOptions`' (NOTEs in ``integrations/budgets.py``).
    With either, attaching is a collective: every rank attaches.
    Then call ``schedule.step(...)`` as usual; `PipelineOffloadManager.detach` undoes it.
    """
    options = ScheduleOptions(
        schedule_policy=schedule_policy,
        prefetch_bytes=prefetch_bytes,
        reload_ahead_bytes=reload_ahead_bytes,
        device_budget_bytes=device_budget_bytes,
        host_budget_bytes=host_budget_bytes,
        timed_reload_ahead=timed_reload_ahead,
    )
    return PipelineOffloadManager(schedule, offload_modules, config=config, streams=streams, options=options)
