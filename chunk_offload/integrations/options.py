"""`ScheduleOptions`: the schedule and budget keywords every integration's ``attach`` takes.

Below `plan_tracking.py` (which checks and applies them) and `attached.py` / `session.py` (which
hold them), so that none of those imports another to name this type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..core import SchedulePolicy

__all__ = ["ScheduleOptions"]


@dataclass(kw_only=True, slots=True)
class ScheduleOptions:
    """The schedule and budget keywords every integration's ``attach`` takes (checked by `PlanTracking`).

    ``schedule_policy``: ``"plan"`` (decisions from the rank's plan), None (reload at group start)
    or a `SchedulePolicy`. ``prefetch_bytes`` / ``reload_ahead_bytes``: `PlanPolicy`'s budgets.
    ``device_budget_bytes``: bytes this rank's device may use (an int, or ``"auto"``: the smallest
    budget every pipeline rank meets), see `budgets.py`. ``host_budget_bytes``: pinned host bytes
    of the whole node, split among its ranks by need. ``timed_reload_ahead``: each chunk's
    reload-ahead bytes from the latest iteration's measured timing, without ``reload_ahead_bytes``
    (NOTE [Timed reload ahead] in core/ordering.py); ``"auto"``: where the engine's streams time
    a device link (NOTE [Timed reload ahead by default] in plan_tracking.py).
    """

    schedule_policy: SchedulePolicy | Literal["plan"] | None = "plan"
    prefetch_bytes: int | None = None
    reload_ahead_bytes: int | None = None
    device_budget_bytes: int | Literal["auto"] | None = None
    host_budget_bytes: int | None = None
    timed_reload_ahead: bool | Literal["auto"] = "auto"
