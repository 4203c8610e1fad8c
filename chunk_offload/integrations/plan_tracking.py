"""What both integrations do with the rank's plan, once.

- `check_schedule_policy`: ``"plan"``, None or a `SchedulePolicy`, refused otherwise;
- `PlanTracking`: the rank's current plan and, under ``schedule_policy="plan"``, the
  `PlanPolicy` built from it on the engine; `observed_plan` turns the order a schedule really
  ran (a list of `Action`s) into a plan, and `diff` says how it differs from the current one.

A plan read from a schedule's tables is checked against the order the schedule really ran; on a
difference the integration warns with both orders side by side (`chunk_offload.core.diff_actions`)
and the observed order becomes the plan (NOTE [Observed order wins] in pipelining/attach.py).
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

from ..core import Action, ChunkOffloadError, OffloadManager, SchedulePolicy
from ..schedule import Plan, PlanPolicy

__all__ = ["PlanTracking", "check_schedule_policy"]


def check_schedule_policy(schedule_policy: Any) -> None:
    """Raise unless ``schedule_policy`` is ``"plan"``, None or a `SchedulePolicy`."""
    if not (schedule_policy is None or schedule_policy == "plan" or isinstance(schedule_policy, SchedulePolicy)):
        raise ChunkOffloadError(
            f"schedule_policy must be 'plan', None (reload at group start) or a SchedulePolicy, got {schedule_policy!r}"
        )


class PlanTracking:
    """The rank's plan and, with ``schedule_policy="plan"``, the engine's `PlanPolicy` from it.

    Construct it (which checks the arguments) before the engine, then `bind` the engine.
    """

    def __init__(
        self,
        schedule_policy: SchedulePolicy | Literal["plan"] | None,
        *,
        prefetch_bytes: int | None,
        reload_ahead_bytes: int | None,
    ) -> None:
        check_schedule_policy(schedule_policy)
        self.from_plan = isinstance(schedule_policy, str)
        given = {k: v for k, v in (("prefetch_bytes", prefetch_bytes), ("reload_ahead_bytes", reload_ahead_bytes)) if v is not None}
        if given and not self.from_plan:
            # Both budgets are read by PlanPolicy only: without the plan they would be dropped silently.
            raise ChunkOffloadError(
                f"{', '.join(f'{k}={v!r}' for k, v in given.items())} needs schedule_policy='plan' "
                f"(--chunk-offload-schedule plan), got schedule_policy={schedule_policy!r} "
                "(--chunk-offload-schedule group-start): prefetch and reload-ahead budgets are planned; "
                "drop them or use the plan"
            )
        """Whether the engine's policy is built from the plan (``schedule_policy="plan"``)."""
        self.engine_policy: SchedulePolicy | None = None if self.from_plan else schedule_policy
        """The policy the engine starts with (None: the engine's default)."""
        self._budgets = PlanPolicy.check_budgets(prefetch_bytes=prefetch_bytes, reload_ahead_bytes=reload_ahead_bytes)
        self._engine: OffloadManager | None = None
        self.plan: Plan | None = None
        """The rank's current plan (None: none known)."""

    def bind(self, engine: OffloadManager) -> None:
        """The engine whose `schedule_policy` `use` sets."""
        self._engine = engine

    def use(self, plan: Plan | None) -> None:
        """Make ``plan`` the current plan; with ``"plan"`` the engine's decisions follow it (none without one)."""
        self.plan = plan
        if self.from_plan:
            self._engine.schedule_policy = PlanPolicy(plan, **self._budgets) if plan is not None else SchedulePolicy()

    def diff(self, observed: Sequence[Action]) -> str | None:
        """How ``observed`` differs from the current plan (None: equal, or no plan)."""
        return None if self.plan is None else self.plan.diff(observed)

    @staticmethod
    def observed_plan(observed: Sequence[Action], *, pp_rank: int, pp_size: int, vp_size: int) -> Plan:
        """The order a schedule ran as a `Plan` (raises `ChunkOffloadError` if it is not a valid one)."""
        return Plan(tuple(observed), pp_rank=pp_rank, pp_size=pp_size, vp_size=vp_size, source="observed")
