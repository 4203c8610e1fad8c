"""`TrainingSession`: one rank's training lifecycle between iterations, owned in one place.

An integration translates its framework's events into session calls: a training iteration
opens and closes (`training_iteration`, or `begin_iteration` / `end_iteration`), a chunk's
forward starts and ends (`chunk_forward_started` / `chunk_forward_ended`, or `chunk`), a chunk's
backward starts (`chunk_backward_started`, `backward_recorder`). The session drives the engine
(an `OffloadManager`, composed) and records the order the chunks ran (`observed_order`). After
each complete training iteration it runs the one after-iteration sequence (`after_iteration`):

1. count the call and keep its record (the baseline iterations' and the latest: `records`);
2. check the order that ran against the plan (the integration's ``check_order``, which may make
   the observed order the plan: NOTE [Observed order wins] in ``pipelining/attach.py``);
3. agree on the budgets across ranks (`PlanTracking.agree_budgets`, the one collective);
4. set the schedule policy and the host pool's cap for the next iteration.

NOTE [Forward-only passes]
A pass trains when its chunk forwards are followed by their backwards: gradients enabled,
inference mode off, and neither the framework's own flag (Megatron's ``forward_only=True`` call
through ``wrap``, a pipelining schedule's ``eval()``) nor a `TrainingSession.forward_only` scope
says otherwise; `TrainingSession.is_training_pass` is that rule, and the adapters ask it alone.
Any other pass (an evaluation, an RL log-probability pass under ``torch.no_grad()`` or
``torch.inference_mode()``, with any number of microbatches) is forward-only: it opens no
iteration and no chunk, so it copies nothing, records no action, is no training call (nor a
baseline one), and leaves the plan, the groups learned, the budgets and the schedule policy as
they were: the next training iteration runs as if the pass had not happened. Only its first
chunk forward may close a complete automatic iteration, as any chunk forward does (NOTE
[Automatic iterations] in ``megatron/auto.py``). Chunk hooks see no flag of the framework: a
forward-only pass with gradients enabled that comes neither through ``wrap`` nor inside
`forward_only` looks like training to them.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..core import (
    Action,
    ActionKind,
    ChunkKey,
    ChunkOffloadError,
    IterationRecord,
    OffloadConfig,
    OffloadManager,
    StreamBackend,
)
from ..schedule import Plan
from .options import ScheduleOptions
from .plan_tracking import PlanTracking

__all__ = ["OrderCheck", "TrainingSession", "check_baseline_iterations"]

OrderCheck = Callable[[Sequence[Action]], None]
"""An integration's check of the order a training iteration ran (its F, B and W actions) against
the plan; it may make another plan current (`TrainingSession.use_plan`)."""


def check_baseline_iterations(baseline_iterations: object) -> None:
    """Raise unless ``baseline_iterations`` is an int >= 0."""
    if isinstance(baseline_iterations, bool) or not isinstance(baseline_iterations, int) or baseline_iterations < 0:
        raise ChunkOffloadError(f"baseline_iterations must be an int >= 0, got {baseline_iterations!r}")


class TrainingSession:
    """The engine, the plan tracking and the baseline records of one rank, and what runs between iterations.

    ``baseline_iterations``: the first N training iterations run without copies (identical
    accounting); their records and the latest one are `records`. ``check_order``: the
    integration's `OrderCheck`. ``pipeline_group`` / ``blocking_exchanges``: `PlanTracking.bind`.
    """

    def __init__(
        self,
        *,
        config: OffloadConfig | None,
        streams: StreamBackend | None,
        options: ScheduleOptions,
        check_order: OrderCheck,
        baseline_iterations: int = 0,
        pipeline_group: dist.ProcessGroup | None = None,
        blocking_exchanges: bool = True,
    ) -> None:
        check_baseline_iterations(baseline_iterations)
        # Every argument is checked before the engine starts its streams.
        self.tracking = PlanTracking(options)
        self.engine = OffloadManager(config, streams=streams, schedule_policy=self.tracking.engine_policy)
        """The offload engine the integration drives."""
        self.tracking.bind(self.engine, pipeline_group=pipeline_group, blocking=blocking_exchanges)
        self.baseline_iterations = baseline_iterations
        self.training_calls = 0
        """Training iterations completed so far (each ran `after_iteration`)."""
        self.observed_order: list[Action] = []
        """The actions of the latest training iteration, as they ran."""
        self._check_order = check_order
        self._baseline_records: list[IterationRecord] = []
        self._last_record: IterationRecord | None = None
        self._forward_only_scopes = 0  # open `forward_only` scopes

    # ------------------------------------------------------------------ plan and results
    @property
    def plan(self) -> Plan | None:
        """This rank's current plan (None: none known)."""
        return self.tracking.plan

    def use_plan(self, plan: Plan | None) -> None:
        """Make ``plan`` the current plan (`PlanTracking.use`)."""
        self.tracking.use(plan)

    @property
    def records(self) -> list[IterationRecord]:
        """The baseline iterations' records, then the latest later iteration's."""
        return self._baseline_records + ([self._last_record] if self._last_record is not None else [])

    def next_offload(self) -> bool | None:
        """``offload=`` of the next training iteration: False while baseline iterations remain."""
        return False if self.training_calls < self.baseline_iterations else None

    # ------------------------------------------------------------------ training or not
    def is_training_pass(self, *, forward_only: bool = False) -> bool:
        """Whether a pass starting now trains (NOTE [Forward-only passes]): not ``forward_only``
        (the framework's flag), no `forward_only` scope open, gradients enabled, inference mode off."""
        if forward_only or self._forward_only_scopes:
            return False
        return torch.is_grad_enabled() and not torch.is_inference_mode_enabled()

    @contextlib.contextmanager
    def forward_only(self) -> Iterator[None]:
        """A forward-only pass (NOTE [Forward-only passes]): no chunk forward inside trains, even with gradients enabled."""
        self._forward_only_scopes += 1
        try:
            yield
        finally:
            self._forward_only_scopes -= 1

    # ------------------------------------------------------------------ framework events
    def begin_iteration(self) -> None:
        """A training iteration opens (a baseline while baseline iterations remain); the order is recorded afresh."""
        self.engine.begin_iteration(offload=self.next_offload())
        self.observed_order = []

    def end_iteration(self, *, discard: bool = False) -> None:
        """The training iteration closes: `after_iteration`, unless ``discard`` (no record, no call)."""
        self.engine.end_iteration(discard=discard)
        if not discard:
            self.after_iteration()

    @contextlib.contextmanager
    def iteration(self, *, offload: bool | None = None) -> Iterator[None]:
        """One iteration as a ``with`` block (`OffloadManager.iteration`), its order recorded afresh;
        no `after_iteration` (a user's own scope, not a training call)."""
        with self.engine.iteration(offload=offload):
            self.observed_order = []  # after the engine's nesting checks
            yield

    @contextlib.contextmanager
    def training_iteration(self) -> Iterator[None]:
        """`begin_iteration` ... `end_iteration` as a ``with`` block; an exception discards the iteration."""
        with self.iteration(offload=self.next_offload()):
            yield
        self.after_iteration()

    def chunk_forward_started(self, *, microbatch: int, vp_stage: int) -> None:
        """A chunk's forward starts: open its scope (`OffloadManager.begin_chunk`) and record its F."""
        if self.engine.begin_chunk(microbatch=microbatch, vp_stage=vp_stage) is not None:
            self.observed_order.append(Action(ActionKind.FORWARD, microbatch, vp_stage))

    def chunk_forward_ended(self, *, abort: bool = False) -> ChunkKey | None:
        """The chunk's forward ended (``abort``: it raised); the chunk's key, None if nothing was tracked."""
        handler = self.engine.end_chunk(abort=abort)
        return None if handler is None else handler.key

    @contextlib.contextmanager
    def chunk(self, *, microbatch: int, vp_stage: int) -> Iterator[None]:
        """`chunk_forward_started` ... `chunk_forward_ended` as a ``with`` block; an exception aborts the chunk."""
        self.chunk_forward_started(microbatch=microbatch, vp_stage=vp_stage)
        try:
            yield
        except BaseException:
            self.chunk_forward_ended(abort=True)
            raise
        self.chunk_forward_ended()

    def chunk_backward_started(self, *, microbatch: int, vp_stage: int, kind: ActionKind = ActionKind.BACKWARD) -> None:
        """A chunk's backward (``B``) or weight step (``W``) starts: record it, inside an iteration."""
        if self.engine.in_iteration:
            self.observed_order.append(Action(kind, microbatch, vp_stage))

    def backward_recorder(self, *, microbatch: int, vp_stage: int) -> Callable[[], None]:
        """What records the chunk's ``B`` in this iteration's order, even when it runs after the iteration closed."""
        order, action = self.observed_order, Action(ActionKind.BACKWARD, microbatch, vp_stage)
        return lambda: order.append(action)

    # ------------------------------------------------------------------ between iterations
    def after_iteration(self) -> None:
        """After a complete training iteration: the after-iteration sequence (see the module docstring)."""
        self.training_calls += 1
        self._keep_record(self.engine.last_iteration)
        self.tracking.iteration_ended()
        self._check_order(self.observed_order)
        decided = self.tracking.agree_budgets(self.engine.last_iteration)
        self.tracking.set_schedule_policy(decided)

    def _keep_record(self, record: IterationRecord | None) -> None:
        if record is None:
            return
        if self.training_calls <= self.baseline_iterations:
            self._baseline_records.append(record)
        else:
            self._last_record = record
