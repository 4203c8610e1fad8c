"""What a replay measured: `ModeResult` (one mode's iterations), `ReplayResult` (both modes,
the drop, R, the table and the JSON summary) and `BudgetReplay` (training under a device budget)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from ..core.actions import NOTATION
from ..core.records import IterationRecord
from ..core.schedule_policy import SchedulePolicy
from ..devkit.host_profile import EngineHostTime
from ..report.stage import StageReport
from ..schedule import Simulation
from ..schedule.plan import Plan
from .driver import Kept

__all__ = ["BudgetReplay", "ModeResult", "ReplayResult"]

_MIB = float(1 << 20)


@dataclass(kw_only=True)
class ModeResult(Kept):
    """The measured iterations of one mode: without offload (baseline) or with it.

    The `Kept` tensors are those of the last measured iteration (grads, outputs and input
    gradients only with ``keep_tensors``).
    """

    offload: bool
    """Whether copies were made."""
    records: list[IterationRecord] = field(repr=False)
    """The manager's record of each measured iteration (peaks, bytes per group, times)."""
    host_time: EngineHostTime | None = None
    """Host time chunk-offload's own code spent per iteration, by function (median of the profiled
    ones, `chunk_offload.devkit.host_profile.engine_host_time`); None when none was profiled."""

    @property
    def last(self) -> IterationRecord:
        return self.records[-1]

    @property
    def step_time_s(self) -> float:
        """Median wall time of the measured iterations."""
        return statistics.median(r.wall_time_s for r in self.records)

    @property
    def peak_bytes(self) -> int:
        """Highest peak of the measured iterations: device memory on CUDA, saved-bytes accounting on CPU."""
        return max(r.peak_bytes for r in self.records)

    @property
    def wait_time_s(self) -> float:
        """Median time per iteration that compute waited on copies."""
        return statistics.median(sum(g.wait_time_s for g in r.groups.values()) for r in self.records)

    @property
    def bytes_offloaded(self) -> int:
        """Bytes copied to host in the last iteration."""
        return sum(g.bytes_offloaded for g in self.last.groups.values())

    @property
    def offload_time_s(self) -> float:
        """Time the device-to-host copies of the last iteration took on their stream."""
        return sum(g.offload_time_s for g in self.last.groups.values())


@dataclass(kw_only=True)
class BudgetReplay:
    """A stage replayed as training runs it under a device budget (`replay_under_budget`)."""

    budget_bytes: int
    """The device budget (``device_budget_bytes``)."""
    result: ModeResult
    """The measured iterations, under the budget's latest choice."""
    report: StageReport = field(repr=False)
    """The stage report of the run: the baseline iteration against the last measured one, R
    under the choice's policy, and the budget fields (``budget_fits``, ``offloaded_groups``)."""

    def summary(self) -> dict[str, Any]:
        """The figures as plain numbers (for JSON)."""
        r, report = self.result, self.report
        return {
            "budget_bytes": self.budget_bytes,
            "budget_fits": report.budget_fits,
            "budget_shortfall_bytes": report.budget_shortfall_bytes,
            "offloaded_groups": dict(report.offloaded_groups),
            "step_time_s": r.step_time_s,
            "peak_bytes": r.peak_bytes,
            "R": report.ratio,
            "bytes_offloaded": r.bytes_offloaded,
            "wait_time_s": r.wait_time_s,
            "offload_copy_time_s": r.offload_time_s,
        }


@dataclass(kw_only=True)
class ReplayResult:
    """A stage's replay with and without offload, and what the schedule predicts."""

    stage: str
    """Which stage, e.g. ``"stage 0 of 4 (2 chunks)"``."""
    plan: Plan = field(repr=False)
    """The actions replayed."""
    modules: list[str]
    """The offloaded module names."""
    recompute_modules: list[str] = field(default_factory=list)
    """megatron's selective recompute in the stage's chunks, in both modes (`MegatronStage.recompute_modules`)."""
    device: str
    """Where it ran."""
    baseline: ModeResult
    """Without offload."""
    offload: ModeResult
    """With offload."""
    schedule_policy: SchedulePolicy
    """The offload and prefetch decisions the offload iterations ran with."""
    simulation: Simulation = field(repr=False)
    """What `chunk_offload.schedule.simulate` predicts for the plan and policy, from the
    baseline's bytes per group."""
    report: StageReport = field(repr=False)
    """The stage's `chunk_offload.report.StageReport` from the measured iterations with the
    highest peak of each mode: the one definition of the drops and of R, as in training."""

    @property
    def theoretical_drop(self) -> int:
        """The report's predicted drop (NOTE [Theoretical drop] in ``chunk_offload/report/stage.py``)."""
        return self.report.theoretical_drop

    @property
    def measured_drop(self) -> int:
        """Peak without offload minus peak with it (device memory on CUDA, accounting on CPU)."""
        return self.report.measured_drop

    @property
    def accounting_drop(self) -> int:
        """The same drop in the manager's accounting of saved bytes (equals the device drop on CPU)."""
        return max(r.peak_resident_bytes for r in self.baseline.records) - max(r.peak_resident_bytes for r in self.offload.records)

    @property
    def ratio(self) -> float | None:
        """R = measured drop / theoretical drop, `StageReport.ratio`: None when the plan predicts no drop."""
        return self.report.ratio

    @property
    def step_time_ratio(self) -> float:
        """Step time with offload / without."""
        return self.offload.step_time_s / self.baseline.step_time_s

    @property
    def host_bandwidth_bytes_per_s(self) -> float:
        """Bytes offloaded / time their device-to-host copies took (NaN without copies)."""
        seconds = self.offload.offload_time_s
        return self.offload.bytes_offloaded / seconds if seconds > 0 else math.nan

    @property
    def reload_bandwidth_bytes_per_s(self) -> float:
        """Bytes reloaded / time their host-to-device copies took (NaN without reloads)."""
        groups = self.offload.last.groups.values()
        seconds = sum(g.reload_time_s for g in groups)
        return sum(g.bytes_reloaded for g in groups) / seconds if seconds > 0 else math.nan

    @property
    def kept_held_elsewhere_bytes(self) -> int:
        """Bytes per iteration the offload kept on device because another reference holds them
        (a copy would free nothing: NOTE [Storages held elsewhere]), from the last measured iteration."""
        return sum(g.bytes_kept_held_elsewhere for g in self.offload.last.groups.values())

    @property
    def unexplained_drop(self) -> int:
        """Measured minus theoretical drop: device memory outside the saved-bytes accounting at the
        two peaks (0 on CPU, where the measure is that accounting)."""
        return self.measured_drop - self.theoretical_drop

    def summary(self) -> dict[str, Any]:
        """The figures of `format` as plain numbers (for JSON)."""
        return {
            "stage": self.stage,
            "plan": self.plan.format(),
            "modules": list(self.modules),
            "recompute_modules": list(self.recompute_modules),
            "device": self.device,
            "schedule_policy": _policy_name(self.schedule_policy),
            "kept_chunks": [list(c) for c in self.simulation.kept],
            "step_time_s": {"baseline": self.baseline.step_time_s, "offload": self.offload.step_time_s},
            "step_time_ratio": self.step_time_ratio,
            "peak_bytes": {"baseline": self.baseline.peak_bytes, "offload": self.offload.peak_bytes},
            "peak_resident_bytes": {
                "baseline": self.baseline.last.peak_resident_bytes,
                "offload": self.offload.last.peak_resident_bytes,
            },
            "measured_drop_bytes": self.measured_drop,
            "accounting_drop_bytes": self.accounting_drop,
            "theoretical_drop_bytes": self.theoretical_drop,
            "R": self.ratio,
            "kept_held_elsewhere_bytes": self.kept_held_elsewhere_bytes,
            "unexplained_drop_bytes": self.unexplained_drop,
            "bytes_offloaded": self.offload.bytes_offloaded,
            # Saved bytes of each group of the first chunk's first forward, in forward order (each
            # layer's offloaded modules in call order), for comparison with the planner's model.
            "first_chunk_group_bytes": list(self.baseline.last.group_bytes.get((0, 0), [])),
            "offload_time_s": self.offload.offload_time_s,
            "wait_time_s": self.offload.wait_time_s,
            "host_bandwidth_bytes_per_s": self.host_bandwidth_bytes_per_s,
            "reload_bandwidth_bytes_per_s": self.reload_bandwidth_bytes_per_s,
        }

    def format(self) -> str:
        """A small table: step time, peak memory, drops, R, host bandwidth."""
        b, o = self.baseline, self.offload
        peak_what = "device peak" if b.last.device_peak_bytes is not None else "saved-bytes peak"
        rows = [
            f"{self.stage}, {self.plan.source}, {len(self.plan.chunks)} chunk forwards, device {self.device}",
            f"offloaded modules: {','.join(self.modules)}; recomputed: {','.join(self.recompute_modules) or 'none'} "
            f"(both columns); policy: {_policy_name(self.schedule_policy)}"
            + (f", {len(self.simulation.kept)} chunk(s) kept on device" if self.simulation.kept else ""),
            f"{'':<28}{'no offload':>14}{'offload':>14}{'ratio':>10}",
            f"{'step time (ms)':<28}{b.step_time_s * 1e3:>14.2f}{o.step_time_s * 1e3:>14.2f}{self.step_time_ratio:>10.3f}",
            f"{peak_what + ' (MiB)':<28}{b.peak_bytes / _MIB:>14.2f}{o.peak_bytes / _MIB:>14.2f}"
            f"{o.peak_bytes / b.peak_bytes if b.peak_bytes else math.nan:>10.3f}",
            f"{'resident saved peak (MiB)':<28}{b.last.peak_resident_bytes / _MIB:>14.2f}{o.last.peak_resident_bytes / _MIB:>14.2f}",
            f"drop: measured {self.measured_drop / _MIB:.2f} MiB, theoretical {self.theoretical_drop / _MIB:.2f} MiB, "
            "R = " + ("n/a (the plan predicts no drop)" if self.ratio is None else f"{self.ratio:.4f}"),
            f"kept on device, held by another reference (a copy frees nothing, not in the theory): "
            f"{self.kept_held_elsewhere_bytes / _MIB:.2f} MiB per iteration",
            f"measured - theoretical drop: {self.unexplained_drop / _MIB:.2f} MiB (device memory outside the saved-bytes "
            "accounting at the two peaks: temporaries, allocator rounding; docs/report.md)",
            f"offloaded {o.bytes_offloaded / _MIB:.2f} MiB per iteration in {o.offload_time_s * 1e3:.2f} ms of copies "
            f"({self.host_bandwidth_bytes_per_s / 1e9:.2f} GB/s to host, {self.reload_bandwidth_bytes_per_s / 1e9:.2f} GB/s back); compute waited {o.wait_time_s * 1e3:.2f} ms",
            NOTATION,
        ]
        return "\n".join(rows)



def _policy_name(policy: SchedulePolicy) -> str:
    return "reload at group start" if type(policy) is SchedulePolicy else repr(policy)
