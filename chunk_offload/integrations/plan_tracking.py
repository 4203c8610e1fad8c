"""What both integrations do with the rank's plan, once.

- `check_schedule_policy`: ``"plan"``, None or a `SchedulePolicy`, refused otherwise;
- `PlanTracking`: the rank's current plan and, under ``schedule_policy="plan"``, the
  `PlanPolicy` built from it on the engine; `observed_plan` turns the order a schedule really
  ran (a list of `Action`s) into a plan, and `diff` says how it differs from the current one;
  after each complete training iteration `agree_budgets` decides the next iteration's policy
  and host cap (the device and host budgets of `budgets.Budgets`, agreed across ranks) and
  `set_schedule_policy` applies them. Without a device budget the decision gives the
  `PlanPolicy` the groups each chunk saved, so that chunks whose backward follows at once copy
  all but their last group from the next iteration on (NOTE [Kept tail] in core/ordering.py).
  The lifespan rule gets no measured timing: copy times vary from run to run, and so would the
  bytes copied (a `PlanPolicy` built with ``timing=CopyTiming.from_record(...)`` and given as
  ``schedule_policy`` uses one).
  With ``timed_reload_ahead`` the reload-ahead budgets do: the latest complete iteration's
  `CopyTiming` is passed as ``reload_timing`` (NOTE [Timed reload ahead] in core/ordering.py; a
  baseline, or an iteration whose order was not the plan's, has none: one group ahead).
  Under a device budget the choice's chunks get them as far as its predicted peak stays within
  the budget (NOTE [Device budget] in budgets.py); a given ``reload_ahead_bytes`` wins over it.
  `session.TrainingSession` calls them in order.

NOTE [Timed reload ahead by default]
Timed reload-ahead budgets change when reloads start, never which bytes are copied, what the
budgets exchange nor any collective, so ranks need not agree on them, and numerics do not change.
They do change the device peak (a chunk's backward starts with more groups on device), so an
iteration's peak follows the previous one's timing. ``"auto"`` (the default) resolves at `bind`
from the engine's streams (`StreamBackend.measures_link`):
- on CUDA streams, on: copy times are the copy engines', steady from one iteration to the next,
  and reloads that start one group ahead leave compute waiting where a group's backward is
  shorter than its reload (one NVIDIA H200, bf16, hidden 4096, five modules per layer, PP=1:
  +16.3% step time one group ahead, +5.2% timed, against +7.3% for megatron's built-in, at a
  lower peak than megatron's: bench/results/2026-11-27-h200);
- on CPU streams, off: copies are worker threads whose timing the host's load decides, so the
  budgets, the peak and every exact comparison of records between runs (the documented report
  run, docs/report.md; the tests) would vary from run to run.
``True`` / ``False`` (``--chunk-offload-timed-reload-ahead on|off``) decide it whatever the streams.
The budgets are made again only when the timing moves: deriving them costs 30 to 140 ms of CPU
per iteration on a 70B-like plan (PP=8 VPP=2, 32 microbatches: 64 chunks of 50 groups;
bench/timed_refit.py), on the training loop's path between iterations, while a GPU's timing
jitters by a few percent from one iteration to the next. So a policy made from one timing is
kept (no new `PlanPolicy`, and under a device budget no new `fit_reload_ahead`) while each later
iteration's timing is `CopyTiming.close_to` it: link rates and action durations within
`TIMING_TOLERANCE` (10%; where they jitter more, every iteration derives them again, as before
the rule). The peak then also stays put while the timing does.

A plan read from a schedule's tables is checked against the order the schedule really ran; on a
difference the integration warns with both orders side by side (`chunk_offload.core.diff_actions`)
and the observed order becomes the plan (NOTE [Observed order wins] in pipelining/attach.py).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Sequence

import torch.distributed as dist

from ..core import Action, ChunkOffloadError, IterationRecord, OffloadManager, SchedulePolicy, check_value, option
from ..schedule import CopyTiming, Plan, PlanPolicy
from .budgets import Budgets
from .layer_split import can_split, split_bound
from .options import ScheduleOptions

__all__ = ["NextIteration", "PlanTracking", "check_schedule_policy"]

logger = logging.getLogger(__name__)


def check_schedule_policy(schedule_policy: Any) -> None:
    """Raise unless ``schedule_policy`` is ``"plan"``, None or a `SchedulePolicy`."""
    if not (schedule_policy is None or schedule_policy == "plan" or isinstance(schedule_policy, SchedulePolicy)):
        raise ChunkOffloadError(
            f"schedule_policy must be 'plan', None (reload at group start) or a SchedulePolicy, got {schedule_policy!r}"
        )


class NextIteration(NamedTuple):
    """What `PlanTracking.agree_budgets` decided for the next training iteration."""

    policy: SchedulePolicy | None
    """The engine's schedule policy from the next iteration on (None: keep the current one)."""
    host_cap: int | None
    """This rank's host pool cap from the node budget (None: no cap decided)."""
    layer_group_bytes: int | None = None
    """The engine's lower layer-group bound from the next iteration on (None: unchanged; NOTE [Budget splits layer groups])."""


class PlanTracking:
    """The rank's plan and, with ``schedule_policy="plan"``, the engine's `PlanPolicy` from it.

    Construct it (which checks the arguments) before the engine, then `bind` the engine.
    """

    def __init__(self, options: ScheduleOptions) -> None:
        schedule_policy = options.schedule_policy
        check_schedule_policy(schedule_policy)
        self.from_plan = isinstance(schedule_policy, str)
        """Whether the engine's policy is built from the plan (``schedule_policy="plan"``)."""
        self._timed_given = check_value(option("ScheduleOptions.timed_reload_ahead"), options.timed_reload_ahead)
        self.timed_reload_ahead = self._timed_given is True
        """Whether the plan's policy sets reload-ahead budgets from the latest iteration's timing
        (``"auto"`` is decided at `bind`: NOTE [Timed reload ahead by default])."""
        self.budgets = Budgets(
            device_budget_bytes=options.device_budget_bytes,
            host_budget_bytes=options.host_budget_bytes,
            prefetch_bytes=options.prefetch_bytes,
            reload_ahead_bytes=options.reload_ahead_bytes,
            timed_reload_ahead=self.timed_reload_ahead,
        )
        """The rank's device and host budget decisions."""
        planned = (
            ("prefetch_bytes", options.prefetch_bytes),
            ("reload_ahead_bytes", options.reload_ahead_bytes),
            ("device_budget_bytes", options.device_budget_bytes),
            ("timed_reload_ahead", True if self._timed_given is True else None),
        )
        given = {k: v for k, v in planned if v is not None}
        if given and not self.from_plan:
            # PlanPolicy alone reads them: without the plan they would be dropped silently.
            raise ChunkOffloadError(
                f"{', '.join(f'{k}={v!r}' for k, v in given.items())} needs schedule_policy='plan' "
                f"(--chunk-offload-schedule plan), got schedule_policy={schedule_policy!r} "
                "(--chunk-offload-schedule group-start): prefetch and reload-ahead budgets and the device budget are "
                "planned; drop them or use the plan"
            )
        self.engine_policy: SchedulePolicy | None = None if self.from_plan else schedule_policy
        """The policy the engine starts with (None: the engine's default)."""
        self._engine: OffloadManager | None = None
        self.plan: Plan | None = None
        """The rank's current plan (None: none known)."""
        self.ran_policy: SchedulePolicy | None = None
        """The engine's policy during the latest complete training iteration (None: none yet)."""
        self._group_bytes: dict[tuple[int, int], list[int]] = {}  # of the last complete iteration
        self._timed_basis: tuple = (None, None, None)  # plan, group bytes and timing the policy was last computed from

    def bind(self, engine: OffloadManager, *, pipeline_group: dist.ProcessGroup | None = None, blocking: bool = True) -> None:
        """The engine whose `schedule_policy` `use` sets; ``timed_reload_ahead="auto"`` follows its streams.

        With a budget that needs an exchange this is a COLLECTIVE over the default group
        (`Budgets.bind`); ``pipeline_group``: the rank's pipeline ranks, ``blocking``: NOTE
        [Deferred exchanges] in ``exchange.py``.
        """
        self._engine = engine
        if self._timed_given == "auto":  # NOTE [Timed reload ahead by default]
            self.timed_reload_ahead = self.from_plan and engine.streams.measures_link
            self.budgets.time_reload_ahead(self.timed_reload_ahead)
        self.budgets.bind(pipeline_group=pipeline_group, blocking=blocking)

    def use(self, plan: Plan | None) -> None:
        """Make ``plan`` the current plan; with ``"plan"`` the engine's decisions follow it (none without one)."""
        self.plan = plan
        if not self.from_plan:
            return
        if plan is None:
            self._engine.schedule_policy = SchedulePolicy()
        elif self.budgets.device_budget is not None:
            self._engine.schedule_policy = self.budgets.policy(plan)
        else:
            self._engine.schedule_policy = self._plan_policy(plan)

    def _plan_policy(self, plan: Plan, reload_timing: CopyTiming | None = None) -> PlanPolicy:
        """The policy without a device budget: the groups of the last record when they cover ``plan``,
        and its timing for the reload-ahead budgets."""
        known = all(chunk in self._group_bytes for chunk in plan.chunks)
        return PlanPolicy(plan, group_bytes=self._group_bytes if known else None, reload_timing=reload_timing, **self.budgets.plan_budgets)

    def _learned_policy(self, record: IterationRecord | None) -> PlanPolicy | None:
        """With the plan and no device budget: the policy following the groups of ``record``, if it changes."""
        if not self.from_plan or self.plan is None or record is None or self.budgets.device_budget is not None:
            return None
        group_bytes = {chunk: list(sizes) for chunk, sizes in record.group_bytes.items()}
        timing = CopyTiming.from_record(record, self.plan) if self.timed_reload_ahead else None
        basis = (self.plan, group_bytes)
        if timing is not None and basis == self._timed_basis[:2] and timing.close_to(self._timed_basis[2]):
            return None  # NOTE [Timed reload ahead by default]: the decisions made from a close timing hold
        self._group_bytes = group_bytes
        self._timed_basis = (*basis, timing)
        policy = self._plan_policy(self.plan, timing)
        current = self._engine.schedule_policy
        if (
            not isinstance(current, PlanPolicy)
            or current.plan is not self.plan
            or (current.copied_head, current.timed_reload_ahead) != (policy.copied_head, policy.timed_reload_ahead)
        ):
            return policy
        return None

    def iteration_ended(self) -> None:
        """Call first when a training iteration closes, before any change of plan: keeps the policy
        it ran under (`ran_policy`, which the report and tests simulate)."""
        self.ran_policy = self._engine.schedule_policy

    def agree_budgets(self, record: IterationRecord | None) -> NextIteration:
        """COLLECTIVE with a budget that needs an exchange: decide the next iteration's policy and host cap.

        Every rank calls it once per complete training iteration (``record``: its record, None
        if discarded), after any change of plan. Without a device budget the plan's policy
        learns the chunks' groups (NOTE [Kept tail]) and, with ``timed_reload_ahead``, from the
        record's timing its reload-ahead budgets (NOTE [Timed reload ahead]); the budgets: NOTEs [Device budget] and
        [Node host budget] in ``budgets.py``, whose exchanges over the pipeline and the node
        are the only cross-rank traffic between iterations.
        """
        policy = self._learned_policy(record)
        budgets = self.budgets
        if not budgets.active:
            return NextIteration(policy, None)
        pp_rank = self.plan.pp_rank if self.plan is not None else 0
        config = self._engine.config
        splits = can_split(config, budgets.device_budget)  # then out of reach splits layer groups, and does not warn
        chosen = budgets.after_iteration(
            self.plan, record, policy if policy is not None else self._engine.schedule_policy, pp_rank=pp_rank, warn_out_of_reach=not splits
        )
        if chosen is not None and splits and not budgets.choice.fits:
            bound = split_bound(config.layer_group_bytes, record)  # NOTE [Budget splits layer groups]
            logger.info(
                "chunk_offload: rank %d: device_budget_bytes %d is %d bytes out of reach of layer groups bounded at %s "
                "bytes: layer groups bounded at %d bytes from the next iteration on (NOTE [Budget splits layer groups])",
                dist.get_rank() if dist.is_initialized() else 0, budgets.device_budget, budgets.shortfall_bytes,
                config.layer_group_bytes, bound,
            )  # fmt: skip
            budgets.forget_choice()
            return NextIteration(budgets.policy(self.plan) if self.from_plan else None, budgets.host_cap, bound)
        if chosen is not None and self.from_plan:
            policy = chosen
        return NextIteration(policy, budgets.host_cap)

    def set_schedule_policy(self, decided: NextIteration) -> None:
        """Apply what `agree_budgets` decided: the engine's schedule policy, its layer groups' bound
        and its host pool's cap."""
        if decided.layer_group_bytes is not None:
            self._engine.regroup(decided.layer_group_bytes)
        if decided.policy is not None:
            self._engine.schedule_policy = decided.policy
        cap = decided.host_cap
        if cap is not None and self._engine.pool.capacity_bytes != cap:
            self._engine.pool.set_capacity(cap)

    def diff(self, observed: Sequence[Action]) -> str | None:
        """How ``observed`` differs from the current plan (None: equal, or no plan)."""
        return None if self.plan is None else self.plan.diff(observed)

    @staticmethod
    def observed_plan(observed: Sequence[Action], *, pp_rank: int, pp_size: int, vp_size: int) -> Plan:
        """The order a schedule ran as a `Plan` (raises `ChunkOffloadError` if it is not a valid one)."""
        return Plan(tuple(observed), pp_rank=pp_rank, pp_size=pp_size, vp_size=vp_size, source="observed")
