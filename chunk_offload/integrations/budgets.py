"""`Budgets`: a rank's device budget (what to offload) and its share of the node's host budget.

Each `TrainingSession` holds one, through `PlanTracking`, whose `agree_budgets` calls
`Budgets.after_iteration` with each complete training iteration's record; it returns the
`PlanPolicy` the engine runs next.

NOTE [Device budget]
- The first iteration without a record offloads every group of every chunk (the lowest peak).
- After each complete iteration (a baseline or an offloaded one), `choose_offload` picks the
  groups to offload from the record's bytes per group, so that `simulate`'s peak fits the
  budget with the fewest bytes copied, preferring copies that hide behind compute (the record's
  `CopyTiming`); a rank that fits offloads nothing. It is recomputed only when the plan, the
  bytes per group, the budget or the availability of a timing changes. The choice is data of the
  policy: ``PlanPolicy(plan, ..., offload_groups=choice)``.
- The measure (NOTE [Report measure] in ``report/stage.py``): on CPU the budget bounds the
  accounting of device-resident saved bytes, exactly. On CUDA it bounds
  ``torch.cuda.max_memory_allocated``: the saved bytes get ``budget - overhead``, where the
  overhead is what the device holds besides them at its peak, ``device_peak_bytes -
  peak_resident_bytes`` of a record (parameters, optimizer state, workspace), the largest seen
  so far, so the choice only becomes more cautious.
- What each group keeps on device even when copied is the latest record's kept bytes plus the
  bytes its chunk learned at its forward end (`IterationRecord.kept_from_now_of`: later chunks at
  those places keep them), and the groups that saved one storage (``group_shared``) are copied
  together (NOTE [Storages held elsewhere]); so a choice made from a baseline, or from an
  iteration that learned places by copying, holds from the next iteration on.
- Bytes per group are the largest each group of each chunk saved so far (reset when the chunks or
  their group counts change): a peak is a sum of group bytes, so with MoE layers, whose expert
  groups follow the routing, the choice holds for any iteration that saves no more than one
  before it did. Dense layers save the same bytes every iteration: predicted == measured.
- An infeasible budget warns once per rank (`budget_shortfall_message`: by how many bytes, and
  what would reach it) and offloads every group. A budget the choice was predicted to meet but
  an iteration run under it exceeded (its measured peak: ``device_peak_bytes`` on CUDA, the
  resident saved bytes on CPU) warns once too (`budget_exceeded_message`). Either way the
  report's ``budget_shortfall_bytes`` says by how much.
- With ``timed_reload_ahead``, once a timing is known the choice is made with the reload-ahead
  budgets it gives (`choose_with_reload_ahead`, NOTE [Reload room]): reloading more than one
  group ahead may raise a backward's peak, so each chunk gets its budget as far as the
  predicted peak stays within the budget, and where the choice made for the budget leaves no
  room (PP=1, the last stage) a choice made for a lower budget may, and is taken when its
  reloads are predicted to wait less. After each later offloaded iteration the choice's chunks
  get the budgets the new timing gives (`fit_reload_ahead`), without a new choice: they change
  when reloads start, never what is copied. The refit is two to four `simulate` runs and the
  derivation: 0.14 s of CPU on the 70B-like plan of NOTE [Budget choice] (rank 0: 64 chunks,
  3,200 groups); so it runs only when the timing moved (`CopyTiming.close_to` the one of the
  latest fit: NOTE [Timed reload ahead by default] in plan_tracking.py).
- ``"auto"``: every pipeline rank's lowest peak (plus its overhead) is all-gathered over the
  pipeline (`Exchange`, NOTE [Deferred exchanges]); the budget is `level_budget` of them, the
  smallest every rank meets. Until it is known every group is offloaded.

NOTE [Node host budget]
After the first record, each rank's host need (`simulate`'s host bytes at the saved peak, under
the policy then in force) is all-gathered over the ranks of its node (by host name), and the
node's budget is split by need (`chunk_offload.schedule.split_host_budget`: early stages get
more). Each rank's host pool takes its share as cap (`HostPool.set_capacity`). Split once.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Literal

import torch.distributed as dist

from ..core import IterationRecord, SchedulePolicy, check_value, option
from ..schedule import (
    CopyTiming,
    OffloadChoice,
    Plan,
    PlanPolicy,
    budget_exceeded_message,
    budget_shortfall_message,
    choose_offload,
    choose_with_reload_ahead,
    fit_reload_ahead,
    level_budget,
    simulate,
    split_host_budget,
)
from .exchange import Exchange, dedicated_group, node_ranks

__all__ = ["Budgets", "check_device_budget", "check_host_budget"]

logger = logging.getLogger(__name__)

def check_device_budget(value: Any) -> int | Literal["auto"] | None:
    """Raise unless ``value`` is None, ``"auto"`` or an int >= 0; return it."""
    return check_value(option("ScheduleOptions.device_budget_bytes"), value)


def check_host_budget(value: Any) -> int | None:
    """Raise unless ``value`` is None or an int >= 0; return it."""
    return check_value(option("ScheduleOptions.host_budget_bytes"), value)


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Budgets:
    """One rank's budget decisions (NOTEs [Device budget] and [Node host budget])."""

    def __init__(
        self,
        *,
        device_budget_bytes: int | Literal["auto"] | None,
        host_budget_bytes: int | None,
        prefetch_bytes: int | None,
        reload_ahead_bytes: int | None,
        timed_reload_ahead: bool = False,
    ) -> None:
        self.device_budget = check_device_budget(device_budget_bytes)
        """The device budget as given: bytes, ``"auto"`` or None."""
        self.host_budget = check_host_budget(host_budget_bytes)  # the node's host budget as given, or None
        self.plan_budgets = PlanPolicy.check_budgets(prefetch_bytes=prefetch_bytes, reload_ahead_bytes=reload_ahead_bytes)
        """`PlanPolicy`'s prefetch and reload-ahead budgets (checked), for every policy built from the plan."""
        self.timed_reload_ahead = False
        """Whether the choice's chunks reload ahead by the latest timing (a given ``reload_ahead_bytes`` wins)."""
        self.time_reload_ahead(timed_reload_ahead)
        self.chunk_reload_ahead: dict[tuple[int, int], int] = {}
        """The choice's per-chunk reload-ahead bytes from the latest timing (`fit_reload_ahead`)."""
        self._fitted_timing: CopyTiming | None = None  # the timing they were derived from
        self.leveled_budget: int | None = None
        """``"auto"``: the levelled budget (the largest lowest peak of the pipeline), once known."""
        self.choice: OffloadChoice | None = None
        """The latest offload choice (None: none yet, or no device budget)."""
        self.overhead_bytes = 0
        """CUDA: device bytes besides the saved ones at the peak (NOTE [Device budget]); 0 on CPU."""
        self.host_cap: int | None = None
        """This rank's host pool cap from the node budget, once split."""
        self.host_needs: list[int] | None = None
        """Every node rank's host need, in node order, once gathered."""
        self.host_caps: list[int] | None = None
        """Every node rank's cap, in node order, once split."""
        self.shortfall_bytes: int | None = None
        """The latest bytes by which the budget was out of reach: predicted (the lowest peak over
        it) or measured (an iteration under a choice that fits peaked over it); None: not seen."""
        self._group_bytes: dict[tuple[int, int], list[int]] = {}
        self._kept_bytes: dict[tuple[int, int], list[int]] = {}  # of the latest record (NOTE [Storages held elsewhere])
        self._shared: dict[tuple[int, int], list[tuple[int, ...]]] = {}  # groups copied together, of the latest record that looked
        self._choice_plan: Plan | None = None
        self._key: tuple | None = None
        self._lowest_key: tuple | None = None
        self._lowest = 0
        self._warned = False
        self._level: Exchange | None = None
        self._node: Exchange | None = None
        self._node_posted = False

    @property
    def active(self) -> bool:
        """Whether a device or a host budget is set."""
        return self.device_budget is not None or self.host_budget is not None

    def bind(self, *, pipeline_group: dist.ProcessGroup | None, blocking: bool) -> None:
        """COLLECTIVE over the default group when a budget needs one: create the exchanges' groups.

        ``pipeline_group``: this rank's pipeline (None: the default group); ``blocking``: NOTE [Deferred exchanges].
        """
        initialized = dist.is_available() and dist.is_initialized()
        if self.device_budget == "auto":
            ranks = dist.get_process_group_ranks(pipeline_group or dist.group.WORLD) if initialized else [0]
            self._level = Exchange(dedicated_group(ranks), blocking=blocking)
        if self.host_budget is not None:
            self._node = Exchange(dedicated_group(node_ranks()), blocking=blocking)

    # ------------------------------------------------------------------ policies
    def policy(self, plan: Plan) -> PlanPolicy:
        """The policy for ``plan``: the choice made for it, else every group offloaded."""
        if self.choice is not None and self._choice_plan is plan:
            return PlanPolicy(plan, offload_groups=self.choice, chunk_reload_ahead=self.chunk_reload_ahead, **self.plan_budgets)
        return PlanPolicy(plan, min_lifespan=0, **self.plan_budgets)

    def after_iteration(
        self, plan: Plan | None, record: IterationRecord | None, policy: SchedulePolicy, *, pp_rank: int, warn_out_of_reach: bool = True
    ) -> PlanPolicy | None:
        """Decide after a complete training iteration; the new policy, or None to keep ``policy``. Every rank calls
        it once per training iteration (its exchanges are collectives). ``warn_out_of_reach``: False where the
        caller splits layer groups instead (NOTE [Budget splits layer groups])."""
        usable = plan is not None and record is not None and all(tuple(c) in record.group_bytes for c in plan.chunks)
        new_policy = None
        if self.device_budget is not None:
            if usable:
                self._check_measured(record, pp_rank=pp_rank)
                self._update_group_bytes(record.group_bytes)
                # What each group keeps on device from the next iteration on: the storages held
                # elsewhere, those this record's chunks learned included (NOTE [Storages held elsewhere]).
                self._kept_bytes = {chunk: record.kept_from_now_of(*chunk) for chunk in record.group_bytes}
                # A new dict (``_choose``'s key compares it): chunks kept whole keep what an earlier record found.
                self._shared = {**self._shared, **{chunk: list(sets) for chunk, sets in record.group_shared.items()}}
            budget = self._budget(plan, record, usable)
            if usable and budget is not None:
                new_policy = self._choose(plan, record, budget, pp_rank=pp_rank, warn=warn_out_of_reach)
        if self._node is not None:
            self._split_host(plan, record, new_policy or policy, usable)
        return new_policy

    def _check_measured(self, record: IterationRecord, *, pp_rank: int) -> None:
        """Warn once when an iteration run under a choice that fits (the latest: a new one applies
        from the next iteration on) peaked over the budget."""
        running = self.choice
        budget = self.device_budget if self.device_budget != "auto" else self.leveled_budget
        if running is None or not running.fits or budget is None or not record.offload:
            return
        peak = record.device_peak_bytes if record.device_peak_bytes is not None else record.peak_resident_bytes
        if peak > budget:
            self.shortfall_bytes = peak - budget
        if peak > budget and not self._warned:
            self._warned = True
            warnings.warn(budget_exceeded_message(rank=pp_rank, budget_bytes=budget, peak_bytes=peak), RuntimeWarning, stacklevel=3)

    def _update_group_bytes(self, recorded: dict[tuple[int, int], list[int]]) -> None:
        """The largest bytes per group so far (NOTE [Device budget]); reset when the chunks or group counts change."""
        known = self._group_bytes
        if known.keys() != recorded.keys() or any(len(known[c]) != len(b) for c, b in recorded.items()):
            self._group_bytes = {c: list(b) for c, b in recorded.items()}
            return
        for chunk, sizes in recorded.items():
            known[chunk] = [max(a, b) for a, b in zip(known[chunk], sizes)]

    def _budget(self, plan: Plan | None, record: IterationRecord | None, usable: bool) -> int | None:
        """The activation budget for the next choice (None: not known yet)."""
        if usable and record.device_peak_bytes is not None:
            self.overhead_bytes = max(self.overhead_bytes, record.device_peak_bytes - record.peak_resident_bytes)
        if self.device_budget != "auto":
            return max(0, self.device_budget - self.overhead_bytes)
        if usable:
            key = (plan, self._group_bytes, self._kept_bytes)
            if key != self._lowest_key:
                self._lowest_key = (plan, {c: list(b) for c, b in self._group_bytes.items()}, self._kept_bytes)
                self._lowest = choose_offload(plan, self._group_bytes, 0, kept_bytes=self._kept_bytes, **self.plan_budgets).lowest_peak_bytes
        # Every rank posts once per iteration, usable or not (a collective).
        peaks = self._level.post(self._lowest + self.overhead_bytes if usable else 0)
        if peaks is not None:
            self.leveled_budget = level_budget(peaks)
        return None if self.leveled_budget is None else max(0, self.leveled_budget - self.overhead_bytes)

    def forget_choice(self) -> None:
        """Drop the choice and the group bytes it was made of: the engine's groups change (NOTE [Budget splits layer groups])."""
        self.choice, self._choice_plan, self._key, self._group_bytes, self._shared = None, None, None, {}, {}

    def time_reload_ahead(self, on: bool) -> None:
        """Reload ahead by the latest timing (``on``), unless a ``reload_ahead_bytes`` was given."""
        self.timed_reload_ahead = on and self.plan_budgets["reload_ahead_bytes"] is None

    def _choose(self, plan: Plan, record: IterationRecord, budget: int, *, pp_rank: int, warn: bool) -> PlanPolicy | None:
        timing = CopyTiming.from_record(record, plan)
        sizes = {c: list(b) for c, b in self._group_bytes.items()}  # a copy: the running maxima change in place
        key = (plan, sizes, self._kept_bytes, self._shared, budget, timing is not None)
        if key == self._key:
            return self._fit_reload_ahead(plan, timing, pp_rank=pp_rank)
        self._key = key
        self.chunk_reload_ahead = {}
        self._fitted_timing = None
        timed = None
        if self.timed_reload_ahead and timing is not None:
            self._fitted_timing = timing
            timed = choose_with_reload_ahead(
                plan, sizes, budget, timing, kept_bytes=self._kept_bytes, shared=self._shared, prefetch_bytes=self.plan_budgets["prefetch_bytes"]
            )
            self.choice = timed.choice
        else:
            self.choice = choose_offload(
                plan, sizes, budget, timing=timing, kept_bytes=self._kept_bytes, shared=self._shared, **self.plan_budgets
            )
        self._choice_plan = plan
        if not self.choice.fits:
            self.shortfall_bytes = self.choice.lowest_peak_bytes - self.choice.budget_bytes
        if not self.choice.fits and not self._warned and warn:
            self._warned = True
            warnings.warn(budget_shortfall_message(self.choice, rank=pp_rank), RuntimeWarning, stacklevel=2)
        # One line per decision and rank: several ranks share a pipeline stage (data and expert
        # parallelism), so the line names the global rank; a budget given as "auto" stays "auto".
        given = f"auto (levelled to {self.leveled_budget} bytes)" if self.device_budget == "auto" else f"{self.device_budget} bytes"
        exposed = self.choice.exposed_s
        lower = ""
        if timed is not None and timed.made_for_bytes != budget:
            lower = (
                f", chosen for {timed.made_for_bytes} bytes to leave room for reloading ahead (NOTE [Reload room]): "
                f"{timed.predicted_wait_s * 1e3:.1f} ms of reload waits predicted against "
                f"{timed.budget_choice_wait_s * 1e3:.1f} ms for the choice made for the budget"
            )
        logger.info(
            "chunk_offload: rank %d (pipeline rank %d): device budget %s, activation budget %d bytes, predicted peak %d, "
            "%d bytes offloaded per iteration%s%s",
            _global_rank(), pp_rank, given, budget, self.choice.predicted_peak_bytes, self.choice.bytes_offloaded,
            "" if exposed is None else f", {exposed * 1e3:.1f} ms of copies not hidden by compute (predicted)", lower,
        )  # fmt: skip
        if timed is not None:
            self._use_reload_ahead(dict(timed.chunk_reload_ahead), pp_rank=pp_rank)
            return self.policy(plan)
        return self._fit_reload_ahead(plan, timing, pp_rank=pp_rank) or self.policy(plan)

    def _fit_reload_ahead(self, plan: Plan, timing: CopyTiming | None, *, pp_rank: int) -> PlanPolicy | None:
        """With ``timed_reload_ahead`` and a timing: the choice's policy with the reload-ahead
        budgets ``timing`` gives that keep it within the budget, if they changed; else None."""
        if not self.timed_reload_ahead or timing is None or timing.close_to(self._fitted_timing):
            return None  # NOTE [Timed reload ahead by default] in plan_tracking.py: budgets from a close timing hold
        self._fitted_timing = timing
        fitted = fit_reload_ahead(
            self.choice, plan, self._group_bytes, timing, prefetch_bytes=self.plan_budgets["prefetch_bytes"], kept_bytes=self._kept_bytes
        )
        if fitted == self.chunk_reload_ahead:
            return None
        self._use_reload_ahead(fitted, pp_rank=pp_rank)
        return self.policy(plan)

    def _use_reload_ahead(self, fitted: dict[tuple[int, int], int], *, pp_rank: int) -> None:
        """Take ``fitted`` as the choice's reload-ahead budgets; log which chunks reload ahead whenever that set changes."""
        if fitted.keys() != self.chunk_reload_ahead.keys():
            copied = sum(1 for groups in self.choice.offloaded.values() if groups)
            logger.info(
                "chunk_offload: rank %d (pipeline rank %d): timed reload ahead in %d of the %d chunks the device budget "
                "offloads (the others reload one group ahead: it waits least there, or reloading more ahead would raise "
                "their backward's peak above the budget)",
                _global_rank(), pp_rank, len(fitted), copied,
            )  # fmt: skip
        self.chunk_reload_ahead = fitted

    def _split_host(self, plan: Plan | None, record: IterationRecord | None, policy: SchedulePolicy, usable: bool) -> None:
        if not self._node_posted:
            self._node_posted = True
            if usable:
                need = simulate(plan, record.group_bytes, policy=policy, kept_bytes=record.kept_bytes_of).host_bytes_at_saved_peak
            else:
                need = record.host_bytes_at_saved_peak if record is not None else 0
            needs = self._node.post(need)
        elif self.host_needs is None:
            needs = self._node.take()
        else:
            return
        if needs is None:
            return
        self.host_needs = needs
        self.host_caps = split_host_budget(self.host_budget, needs)
        self.host_cap = self.host_caps[self._node.rank]

    def summary(self, record: IterationRecord | None) -> dict[str, Any]:
        """The report's budget fields (`chunk_offload.report.stage_report`'s ``budgets``); ``record``
        names the groups of the choice (its ``group_names``)."""
        choice = self.choice
        return {
            "device_budget": self.device_budget,
            "leveled_budget": self.leveled_budget,
            "offloaded_groups": choice.offloaded_by_name(record.group_names) if choice is not None and record is not None else {},
            "budget_fits": choice.fits if choice is not None else None,
            "budget_shortfall_bytes": self.shortfall_bytes,
            "host_budget": self.host_budget,
            "host_cap": self.host_cap,
        }
