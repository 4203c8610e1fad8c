"""`StageReport`: one pipeline rank's peak memory without and with offload, against the plan's prediction.

A report compares two iterations of the same run: a baseline iteration that tracked the same
groups and bytes but copied nothing, and an iteration with offload. The theoretical drop comes
from the rank's plan: `chunk_offload.schedule.simulate` replays the plan's actions with the
recorded bytes per group and predicts how far the peak falls when the chunks in flight are on
host (NOTE [Theoretical drop]).

NOTE [Report measure]
On CUDA the peak is ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` at the
start of each iteration (`IterationRecord.device_peak_bytes`): everything on the device,
parameters, optimizer state and workspace included, so the drop is what a user gains. On CPU
there is no device allocator to ask, and the peak is the manager's own accounting of
device-resident saved bytes of the offloaded modules (`IterationRecord.peak_resident_bytes`).
The simulation mirrors that accounting step for step, so on CPU R is exactly 1 when the engine
does what the plan says; on CUDA R below 1 measures what the allocator keeps (copy buffers,
fragmentation, tensors the policy kept on device). Every report names its measure.

NOTE [Theoretical drop]
The theoretical drop is the simulated peak without offload, from the baseline iteration's bytes
per group, minus the simulated peak with offload, from the offload iteration's bytes per group
and the bytes each of its groups kept on device (`IterationRecord.group_kept_bytes`: storages
another reference holds, which a copy would not free; NOTE [Storages held elsewhere]).
When both iterations save the same bytes per group (dense models: shapes fix the bytes) this is
``simulate(plan, bytes).drop``: the bytes of the chunks on host at the stage's peak. With MoE
layers the bytes of an expert's group follow the routing, which changes between iterations;
predicting each peak from its own iteration keeps that change out of R, so R still measures
only how far the device falls short of the plan.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Literal, Mapping

from ..core.errors import ChunkOffloadError
from ..core.schedule_policy import SchedulePolicy
from ..core.records import IterationRecord
from ..schedule import Plan, simulate

__all__ = ["MEASURES", "Measure", "StageReport", "stage_report"]

Measure = Literal["cuda_max_memory_allocated", "cpu_saved_bytes_accounting"]

MEASURES: dict[str, str] = {
    "cuda_max_memory_allocated": "torch.cuda.max_memory_allocated after reset_peak_memory_stats, per iteration",
    "cpu_saved_bytes_accounting": "on CPU, the manager's accounting of device-resident saved bytes of the offloaded modules",
}
"""Each measure a report can use, with what it means (see NOTE [Report measure])."""


@dataclass(kw_only=True, slots=True)
class StageReport:
    """One rank's memory without and with offload (see NOTE [Report measure]).

    ``measured_drop`` and ``ratio`` (R) are derived, so they always agree with the peaks.
    """

    rank: int
    """Global rank."""
    pp_rank: int
    """Pipeline stage of this rank."""
    pp_size: int
    """Pipeline stages."""
    vp_size: int
    """Model chunks (virtual stages) on this rank."""
    measure: Measure
    """What the peaks and traces count: a key of `MEASURES`."""
    peak_without: int
    """Peak bytes of the baseline iteration (no offload)."""
    peak_with: int
    """Peak bytes of the iteration with offload."""
    theoretical_drop: int
    """``predicted_peak_without - predicted_peak_with`` (NOTE [Theoretical drop])."""
    predicted_peak_without: int
    """Simulated peak of the saved bytes of the offloaded modules without offload (baseline's bytes per group)."""
    predicted_peak_with: int
    """Simulated peak of their device-resident saved bytes with offload (offload iteration's bytes per group)."""
    bytes_per_module: dict[str, int] = field(default_factory=dict)
    """Bytes copied to host in the offload iteration, per offloaded module name."""
    kept_held_elsewhere_bytes: int = 0
    """Bytes the offload iteration kept on device because another reference holds them (a copy
    would free nothing; NOTE [Storages held elsewhere] in core/held_elsewhere.py)."""
    copy_ms: float = 0.0
    """Offload plus reload copy time of the offload iteration, in milliseconds."""
    wait_ms: float = 0.0
    """Time compute waited on copies in the offload iteration, in milliseconds."""
    trace_without: list[int] = field(default_factory=list)
    """The measure after each accounting change of the baseline iteration."""
    trace_with: list[int] = field(default_factory=list)
    """The same over the offload iteration."""
    baseline_iteration: int | None = None
    """0-based number of the baseline iteration in the run (None: not known)."""
    offload_iteration: int | None = None
    """0-based number of the offload iteration in the run (None: not known)."""
    device_budget: int | str | None = None
    """The rank's device budget as given: bytes, ``"auto"``, or None (no budget)."""
    leveled_budget: int | None = None
    """With ``"auto"``: the levelled budget (the largest lowest peak of the pipeline's ranks)."""
    offloaded_groups: dict[str, int] = field(default_factory=dict)
    """With a device budget: per offloaded module, the groups the budget's choice copies to host."""
    budget_fits: bool | None = None
    """With a device budget: whether the choice's predicted peak fits it (False: lowest peak taken)."""
    budget_shortfall_bytes: int | None = None
    """With a device budget: the latest bytes by which it was out of reach, predicted (lowest peak
    over it) or measured (a peak over it under a choice that fits); None: never."""
    host_budget: int | None = None
    """The node's host budget (``--chunk-offload-host-budget``), or None."""
    host_cap: int | None = None
    """This rank's host pool cap, its share of the node's host budget (None: no budget, or not split yet)."""

    @property
    def measured_drop(self) -> int:
        """``peak_without - peak_with``."""
        return self.peak_without - self.peak_with

    @property
    def ratio(self) -> float | None:
        """R = measured drop / theoretical drop; None when the plan predicts no drop (theoretical <= 0:
        every chunk kept on device, or, with MoE, more bytes in the offload iteration than offload frees)."""
        return self.measured_drop / self.theoretical_drop if self.theoretical_drop > 0 else None

    # ------------------------------------------------------------------ plain data
    def to_dict(self) -> dict[str, Any]:
        """Every field plus ``measured_drop`` and ``R``, as JSON-ready plain data."""
        out = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        out["measured_drop"] = self.measured_drop
        out["R"] = self.ratio
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StageReport":
        """The inverse of `to_dict`; the derived ``measured_drop`` and ``R`` must match the peaks."""
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        unknown = sorted(set(data) - names - {"measured_drop", "R"})
        missing = sorted(required - set(data))
        if unknown or missing:
            raise ChunkOffloadError(
                f"stage report has unknown fields {unknown} and lacks fields {missing}; valid: {sorted(names)}"
            )
        if data["measure"] not in MEASURES:
            raise ChunkOffloadError(f"stage report measure {data['measure']!r} is not one of {sorted(MEASURES)}")
        report = cls(**{k: v for k, v in data.items() if k in names})
        for key, value in (("measured_drop", report.measured_drop), ("R", report.ratio)):
            if key in data and data[key] != value:
                raise ChunkOffloadError(
                    f"stage report of rank {report.rank}: {key}={data[key]!r} does not match its peaks "
                    f"({report.peak_without} without, {report.peak_with} with offload, theoretical "
                    f"{report.theoretical_drop}) which give {value!r}"
                )
        report.bytes_per_module = dict(report.bytes_per_module)
        report.offloaded_groups = dict(report.offloaded_groups)
        report.trace_without = list(report.trace_without)
        report.trace_with = list(report.trace_with)
        return report


_BUDGET_FIELDS = ("device_budget", "leveled_budget", "offloaded_groups", "budget_fits", "budget_shortfall_bytes", "host_budget", "host_cap")


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    return value


def stage_report(
    *,
    baseline: IterationRecord,
    offloaded: IterationRecord,
    plan: Plan,
    rank: int,
    policy: SchedulePolicy | None = None,
    baseline_iteration: int | None = None,
    offload_iteration: int | None = None,
    budgets: Mapping[str, Any] | None = None,
) -> StageReport:
    """Build a rank's `StageReport` from a baseline record, an offload record and the rank's plan.

    Args:
        baseline: the `IterationRecord` of an iteration run without offload.
        offloaded: the `IterationRecord` of an iteration run with offload.
        plan: the rank's `chunk_offload.schedule.Plan`.
        rank: the global rank, for the table's rows.
        policy: the schedule policy the manager used (None: the engine's default decisions);
            the simulation applies the same one.
        baseline_iteration, offload_iteration: 0-based numbers of the two iterations in the run.
        budgets: the budget fields (``device_budget``, ``leveled_budget``, ``offloaded_groups``,
            ``budget_fits``, ``budget_shortfall_bytes``, ``host_budget``, ``host_cap``) as the
            integration's budgets summarize them.
    """
    budget_fields = {f.name for f in fields(StageReport)} & set(_BUDGET_FIELDS)
    unknown = sorted(set(budgets or {}) - budget_fields)
    if unknown:
        raise ChunkOffloadError(f"stage_report: unknown budget fields {unknown}; valid: {sorted(budget_fields)}")
    if baseline.offload:
        raise ChunkOffloadError("stage_report: the baseline record ran with offload; pass a record of an iteration with offload=False")
    if not offloaded.offload:
        raise ChunkOffloadError("stage_report: the offload record ran without offload; pass a record of an iteration with offload=True")
    # See NOTE [Theoretical drop]: each peak is predicted from the bytes of its own iteration.
    without = simulate(plan, _bytes_of(baseline, plan, "baseline"), policy=policy)
    with_offload = simulate(plan, _bytes_of(offloaded, plan, "offload"), policy=policy, kept_bytes=offloaded.kept_bytes_of)
    cuda = [r.device_peak_bytes is not None for r in (baseline, offloaded)]
    if cuda[0] != cuda[1]:
        raise ChunkOffloadError(
            "stage_report: one record has a CUDA peak (device_peak_bytes) and the other not; both iterations must run on the same device"
        )
    if cuda[0]:
        measure: Measure = "cuda_max_memory_allocated"
        peaks = (baseline.device_peak_bytes, offloaded.device_peak_bytes)
        traces = (baseline.device_trace or [], offloaded.device_trace or [])
    else:
        measure = "cpu_saved_bytes_accounting"
        peaks = (baseline.peak_resident_bytes, offloaded.peak_resident_bytes)
        traces = (baseline.resident_trace or [], offloaded.resident_trace or [])
    groups = offloaded.groups
    return StageReport(
        rank=rank,
        pp_rank=plan.pp_rank,
        pp_size=plan.pp_size,
        vp_size=plan.vp_size,
        measure=measure,
        peak_without=int(peaks[0]),
        peak_with=int(peaks[1]),
        theoretical_drop=int(without.peak_saved_bytes - with_offload.peak_resident_bytes),
        predicted_peak_without=int(without.peak_saved_bytes),
        predicted_peak_with=int(with_offload.peak_resident_bytes),
        bytes_per_module={name: int(g.bytes_offloaded) for name, g in groups.items()},
        kept_held_elsewhere_bytes=sum(int(g.bytes_kept_held_elsewhere) for g in groups.values()),
        copy_ms=sum(g.offload_time_s + g.reload_time_s for g in groups.values()) * 1e3,
        wait_ms=sum(g.wait_time_s for g in groups.values()) * 1e3,
        trace_without=[int(b) for b in traces[0]],
        trace_with=[int(b) for b in traces[1]],
        baseline_iteration=baseline_iteration,
        offload_iteration=offload_iteration,
        **dict(budgets or {}),
    )


def _bytes_of(record: IterationRecord, plan: Plan, which: str) -> Callable[[int, int], list[int]]:
    """``(microbatch, vp_stage) -> bytes per group`` of ``record``, checked against the plan's chunks."""
    group_bytes = record.group_bytes
    missing = [chunk for chunk in plan.chunks if tuple(chunk) not in group_bytes]
    if missing:
        raise ChunkOffloadError(
            f"stage_report: the {which} iteration recorded no groups for chunks {missing} of plan {plan.source!r} "
            f"(recorded: {sorted(group_bytes)}); the plan must be the schedule that iteration ran"
        )
    return lambda microbatch, vp_stage: group_bytes[(microbatch, vp_stage)]
