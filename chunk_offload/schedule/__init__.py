"""The plan: each pipeline rank's ordered actions, and the decisions taken from it.

- `Plan`: the actions (`chunk_offload.core.Action`) of one rank for one iteration, as data;
- `megatron_plan`: Megatron's 1F1B and interleaved 1F1B plans, from Megatron's own tables;
- `PlanPolicy`: offload by lifespan and prefetch the next backward chunk (a `SchedulePolicy`);
- `simulate`: the saved-bytes accounting a plan gives, exact against the engine's;
- `choose_offload`: the groups to copy so that a rank's predicted peak fits a device budget
  (`OffloadChoice`, `CopyTiming`, `level_budget`, `budget_shortfall_message`,
  `budget_exceeded_message`); `fit_reload_ahead`: timed reload-ahead budgets that keep it, and
  `choose_with_reload_ahead` (`TimedChoice`): a choice that leaves them room;
- `split_host_budget`, `node_host_cap`: a node's host-memory budget split among its ranks by need.
"""

from .budget import (
    CopyTiming,
    OffloadChoice,
    budget_exceeded_message,
    budget_shortfall_message,
    choose_offload,
    level_budget,
)
from .budget_reload import TimedChoice, choose_with_reload_ahead, fit_reload_ahead
from .host_budget import all_gather_host_needs, node_host_cap, split_host_budget
from .megatron import megatron_plan
from .plan import Plan
from .plan_policy import PlanPolicy
from .simulate import Simulation, simulate

__all__ = [
    "CopyTiming",
    "OffloadChoice",
    "Plan",
    "PlanPolicy",
    "Simulation",
    "TimedChoice",
    "all_gather_host_needs",
    "budget_exceeded_message",
    "budget_shortfall_message",
    "choose_offload",
    "choose_with_reload_ahead",
    "fit_reload_ahead",
    "level_budget",
    "megatron_plan",
    "node_host_cap",
    "simulate",
    "split_host_budget",
]
