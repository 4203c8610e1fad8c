"""`StageSummary`: what offload did on one rank in the last training iteration, for the launcher's closing summary.

Built on every rank from what its manager already holds (the latest training iteration's
`IterationRecord`, the modules it registered, its budgets' decision and, with
``--chunk-offload-report``, its `StageReport`), gathered to rank 0 with the explicit collective
`chunk_offload.report.gather_objects`, and rendered there by `closing.py`. When a rank copied
nothing, `why_nothing` says why from the same data (see NOTE [Ranks that copied nothing] in
``report/render.py`` for the report's own wording of the same cases).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

from ..core import ChunkOffloadError
from ..report import StageReport

if TYPE_CHECKING:
    from ..integrations.megatron import MegatronOffloadManager

__all__ = ["StageSummary", "absent_modules", "stage_summary", "why_nothing"]


@dataclass(kw_only=True, slots=True)
class StageSummary:
    """One rank's offload in its latest training iteration (plain data, gathered to rank 0)."""

    rank: int
    """Global rank."""
    requested: list[str]
    """``--chunk-offload-modules`` (canonical names)."""
    attached: bool = False
    """Whether a manager was attached on the rank (False: Megatron-LM built no model)."""
    pp_rank: int | None = None
    """Pipeline stage of the rank (None: no plan, no training iteration ran)."""
    pp_size: int | None = None
    """Pipeline stages."""
    registered: dict[str, int] = field(default_factory=dict)
    """Offload-module name -> submodules found in this rank's chunks (a name matching none is absent)."""
    groups: dict[str, int] = field(default_factory=dict)
    """Group name -> groups its forwards formed in the latest training iteration."""
    training_calls: int = 0
    """Training iterations completed."""
    offload: bool | None = None
    """Whether the latest training iteration copied (False: a baseline iteration; None: none ran)."""
    baseline: bool = False
    """``--chunk-offload-baseline``: the manager tracks but never copies."""
    bytes_per_module: dict[str, int] = field(default_factory=dict)
    """Bytes copied to host in the latest training iteration, per module name."""
    kept_held_elsewhere_bytes: int = 0
    """Bytes kept on device in it because another reference holds them (a copy would free nothing)."""
    saved_peak_bytes: int = 0
    """Peak saved bytes of the offloaded modules in it, wherever they lived (0: nothing reached
    ``--chunk-offload-min-offload-bytes``)."""
    peak_bytes: int | None = None
    """Its peak: the device's (CUDA ``max_memory_allocated``) or, on CPU, the accounting's."""
    measure: str | None = None
    """What ``peak_bytes`` counts: a key of `chunk_offload.report.MEASURES`."""
    wait_ms: float = 0.0
    """Time compute waited on copies in it, in milliseconds."""
    iteration_ms: float = 0.0
    """Its wall time, in milliseconds (0: no iteration recorded)."""
    timed_reload_ahead: bool = False
    """Whether the rank's reloads start by the measured timing (``--chunk-offload-timed-reload-ahead``;
    by default on CUDA streams: NOTE [Timed reload ahead by default])."""
    min_offload_bytes: int = 0
    """``--chunk-offload-min-offload-bytes``."""
    min_offload_flag: str = ""
    """That flag and its value as the command line typed it (``--chunk-offload-min-offload-bytes 1MiB``),
    for the messages that quote it (`chunk_offload.option_flags.typed_flag`); empty: not known,
    the messages quote ``min_offload_bytes``."""
    budget_fits: bool | None = None
    """With a device budget: whether its choice fits (None: no budget, or no choice yet)."""
    report: StageReport | None = None
    """The rank's `StageReport` (``--chunk-offload-report``), which has the measured drop and R."""
    report_error: str | None = None
    """Why the rank has no report although one was asked for."""
    planned_nothing: bool = False
    """``--chunk-offload-plan`` offloads nothing on this stage (no manager: none is needed)."""

    @property
    def bytes_offloaded(self) -> int:
        """Bytes copied to host in the latest training iteration."""
        return sum(self.bytes_per_module.values())


def stage_summary(
    manager: MegatronOffloadManager | None,
    *,
    requested: list[str],
    report: bool,
    planned_nothing: bool = False,
    min_offload_flag: str = "",
) -> StageSummary:
    """This rank's `StageSummary`; ``manager`` None: nothing was attached (no model built, or
    ``planned_nothing``: the plan offloads nothing on this stage, which then needs no report).
    ``min_offload_flag``: ``--chunk-offload-min-offload-bytes`` as typed (empty: the messages
    quote the manager's parsed value).

    ``report``: build the rank's `StageReport` too (``--chunk-offload-report``). In auto mode
    the open iteration, complete after training, is closed first.
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    summary = StageSummary(rank=rank, requested=list(requested), planned_nothing=planned_nothing)
    if manager is None:
        if report and not planned_nothing:
            summary.report_error = "no model was attached (Megatron-LM built none)"
        return summary
    if manager.iterations == "auto":
        try:
            manager.end_iteration()
        except ChunkOffloadError:
            manager.end_iteration(discard=True)  # an incomplete step: nothing to summarize of it
    if report:
        try:
            summary.report = manager.report()
        except ChunkOffloadError as e:
            summary.report_error = str(e).removeprefix("chunk_offload: ")
    records = manager.records
    record = records[-1] if records else None
    summary.attached = True
    summary.registered = dict(manager.registered)
    summary.training_calls = manager.training_calls
    summary.baseline = not manager.config.offload
    summary.min_offload_bytes = manager.config.min_offload_bytes
    summary.min_offload_flag = min_offload_flag
    if manager.plan is not None:
        summary.pp_rank, summary.pp_size = manager.plan.pp_rank, manager.plan.pp_size
    if record is None:
        return summary
    summary.offload = record.offload
    summary.groups = {name: g.groups for name, g in record.groups.items()}
    summary.bytes_per_module = {name: g.bytes_offloaded for name, g in record.groups.items()}
    summary.kept_held_elsewhere_bytes = sum(g.bytes_kept_held_elsewhere for g in record.groups.values())
    summary.saved_peak_bytes = record.peak_saved_bytes
    summary.peak_bytes = record.peak_bytes
    summary.measure = "cpu_saved_bytes_accounting" if record.device_peak_bytes is None else "cuda_max_memory_allocated"
    summary.wait_ms = sum(g.wait_time_s for g in record.groups.values()) * 1e3
    summary.iteration_ms = record.wall_time_s * 1e3
    summary.timed_reload_ahead = manager.tracking.timed_reload_ahead
    if manager.budgets.active:
        summary.budget_fits = manager.budgets.summary(record)["budget_fits"]
    return summary


def why_nothing(summary: StageSummary) -> str | None:
    """Why the rank copied nothing in its latest training iteration, as a user reads it; None if it copied."""
    if summary.bytes_offloaded:
        return None
    if summary.planned_nothing:
        return "--chunk-offload-plan offloads nothing on its stage: the stage fits the device budget without"
    if summary.baseline:
        return "--chunk-offload-baseline tracks the saved bytes but copies nothing"
    if summary.offload is None:
        return "no training iteration completed with chunk-offload attached"
    if not summary.offload:
        return (
            "its only training iterations ran as the report's baseline, without copies (--chunk-offload-report runs "
            "the first one so); train 2 iterations or more"
        )
    if not any(summary.groups.values()):
        idle = [n for n in summary.requested if n in summary.registered]
        if idle:
            return f"{','.join(idle)} never ran in a training forward"
        return "no module of --chunk-offload-modules is in its model"
    if summary.kept_held_elsewhere_bytes:
        return (
            f"another reference holds what the offloaded modules saved ({summary.kept_held_elsewhere_bytes} bytes), so a "
            "copy would free nothing and it stays on device (NOTE [Storages held elsewhere] in core/held_elsewhere.py)"
        )
    if summary.saved_peak_bytes == 0:
        flag = summary.min_offload_flag or f"--chunk-offload-min-offload-bytes {summary.min_offload_bytes}"
        return (
            f"no saved tensor of {','.join(n for n, k in summary.groups.items() if k)} reached {flag} (default 1 MiB); "
            "a small model needs a lower threshold, e.g. --chunk-offload-min-offload-bytes 0"
        )
    if summary.budget_fits:
        return "its peak without offload fits --chunk-offload-device-budget"
    return (
        "the plan kept every chunk on device: each chunk's backward follows its forward at once (the last pipeline "
        "stage without virtual stages, or PP=1)"
    )


def absent_modules(summaries: list[StageSummary]) -> dict[str, list[int]]:
    """Requested module name -> the ranks on which it matches no submodule."""
    absent: dict[str, list[int]] = {}
    for summary in summaries:
        for name in summary.requested:
            if summary.attached and name not in summary.registered:
                absent.setdefault(name, []).append(summary.rank)
    return absent
