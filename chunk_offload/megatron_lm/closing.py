"""`close_run`: the launcher's last words on rank 0, from the gathered `StageSummary` of every rank.

A table with a row per rank (pipeline stage, bytes offloaded per iteration, device peak, measured
drop and R where the report has them, compute wait), the reasons of ranks that copied nothing
(warnings when no rank copied anything), the ranks whose reloads follow the measured timing
(`timed_reloads_line`), a hint where compute waited on its copies on a GPU (`wait_hint`), and
where the report files are. With
``--chunk-offload-report`` the report is written here; a failure to write it is an error of the
run (exit status 1), after the summary and the report's table are printed all the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..core import ChunkOffloadError
from ..core.actions import NOTATION
from ..report import MEASURES, ReportFiles, format_table, write_report
from ..report.render import table_lines
from .summary import StageSummary, absent_modules, why_nothing

__all__ = ["WAIT_HINT_SHARE", "Closing", "close_run", "timed_reloads_line", "wait_hint"]


@dataclass(kw_only=True, slots=True)
class Closing:
    """What the launcher prints at the end of a run (on rank 0) and how it exits."""

    summary: str = ""
    """The summary, for stdout."""
    warnings: list[str] = field(default_factory=list)
    """One line each, for stderr."""
    error: str | None = None
    """Why the run failed at its end (exit status 1), e.g. the report could not be written."""
    files: ReportFiles | None = None
    """The report files written (``png`` None: not drawn)."""


def _drop(s: StageSummary) -> str:
    return "-" if s.report is None or not s.bytes_offloaded else str(s.report.measured_drop)


def _ratio(s: StageSummary) -> str:
    return "-" if s.report is None or s.report.ratio is None or not s.bytes_offloaded else f"{s.report.ratio:.2%}"


_COLUMNS = (
    ("rank", "r", lambda s: str(s.rank)),
    ("pp", "r", lambda s: "-" if s.pp_rank is None else f"{s.pp_rank}/{s.pp_size}"),
    ("offloaded per iteration (B)", "r", lambda s: str(s.bytes_offloaded)),
    ("device peak (B)", "r", lambda s: "-" if s.peak_bytes is None else str(s.peak_bytes)),
    ("measured drop (B)", "r", _drop),
    ("R", "r", _ratio),
    ("wait ms", "r", lambda s: f"{s.wait_ms:.2f}"),
    ("offloaded per module (B)", "l", lambda s: ",".join(f"{n}:{b}" for n, b in s.bytes_per_module.items()) or "-"),
)


def close_run(summaries: Sequence[StageSummary] | None, *, report_path: str | None) -> Closing:
    """The closing of a run: ``summaries`` gathered from every rank (None: ``--chunk-offload-modules`` not given).

    Writes the report (`write_report`) when ``report_path`` is given and every rank has one.
    """
    if summaries is None:
        return Closing(warnings=["nothing was offloaded: no --chunk-offload-modules given"])
    summaries = sorted(summaries, key=lambda s: (s.pp_rank if s.pp_rank is not None else -1, s.rank))
    closing = Closing()
    files_line = _write(summaries, report_path, closing)
    reasons: dict[str, list[int]] = {}
    for s in summaries:
        reason = why_nothing(s)
        if reason:
            reasons.setdefault(reason, []).append(s.rank)
    copied = any(s.bytes_offloaded for s in summaries)
    lines = [_title(summaries)]
    measures = dict.fromkeys(s.measure for s in summaries if s.measure)
    lines += [f"device peak: {MEASURES[m]}" for m in measures]
    lines += ["", *table_lines(_COLUMNS, summaries), ""]
    absent = [
        f"--chunk-offload-modules {name} matches no submodule on {_ranks(ranks)}: nothing of it is offloaded there"
        for name, ranks in absent_modules(summaries).items()
    ]
    if copied:  # notes: the run offloaded, some modules or ranks did not
        lines += [*absent, *(f"{_ranks(ranks)} copied nothing: {reason}" for reason, ranks in reasons.items())]
        lines += timed_reloads_line(summaries) + wait_hint(summaries)
    else:
        closing.warnings += [*absent, *(f"nothing was offloaded on {_ranks(ranks)}: {reason}" for reason, ranks in reasons.items())]
    lines += [files_line, NOTATION]
    if closing.error is not None and all(s.report is not None or s.planned_nothing for s in summaries):
        lines += ["", "the report that could not be written:", "", format_table([s.report for s in summaries if s.report is not None])]
    closing.summary = "\n".join(lines)
    return closing


def timed_reloads_line(summaries: Sequence[StageSummary]) -> list[str]:
    """One line naming the ranks whose reloads started by the previous iteration's copy timing (by
    default on CUDA streams: NOTE [Timed reload ahead by default]): their peak follows each run's
    timing, so two runs of one job may peak differently; a user comparing runs learns why and how
    to pin it."""
    timed = [s.rank for s in summaries if s.timed_reload_ahead and s.offload and s.bytes_offloaded]
    if not timed:
        return []
    return [
        f"{_ranks(timed)}: reloads start by the previous iteration's measured copy timing (timed reload ahead), so "
        "the device peak follows each run's timing; --chunk-offload-timed-reload-ahead off reloads one group ahead"
    ]


WAIT_HINT_SHARE = 0.02
"""`wait_hint` speaks from this share of an iteration spent waiting on copies."""


def wait_hint(summaries: Sequence[StageSummary]) -> list[str]:
    """One line for the ranks whose compute waited on copies for `WAIT_HINT_SHARE` of their last
    iteration or more, on a GPU, with timed reload ahead off (``--chunk-offload-timed-reload-ahead
    off``): a chunk's backward then reloads one group ahead, which a link slower than the
    backward of the groups between (norms, small projections) leaves waiting; the timed budgets
    start each reload early enough by the measured copy timing (NOTE [Timed reload ahead] in
    core/ordering.py; on by default on a GPU).
    On CPU streams the waits are the host's thread scheduling, not a link: no hint there."""
    waiting = [
        s for s in summaries
        if s.measure == "cuda_max_memory_allocated" and s.offload and not s.timed_reload_ahead and s.iteration_ms > 0
        and s.wait_ms >= WAIT_HINT_SHARE * s.iteration_ms
    ]  # fmt: skip
    if not waiting:
        return []
    worst = max(waiting, key=lambda s: s.wait_ms / s.iteration_ms)
    return [
        f"{_ranks([s.rank for s in waiting])}: compute waited on copies for up to {worst.wait_ms:.1f} ms of a "
        f"{worst.iteration_ms:.1f} ms iteration ({worst.wait_ms / worst.iteration_ms:.0%}, rank {worst.rank}): where reloads lag "
        "the backward, --chunk-offload-timed-reload-ahead on starts each one early enough by the measured copy timing"
    ]


def _write(summaries: list[StageSummary], report_path: str | None, closing: Closing) -> str:
    """Write the report (if asked for); the line that says where it is, or why it is not."""
    if not report_path:
        return "report: none (--chunk-offload-report PATH adds the peak without offload, the measured drop and R)"
    missing = [s for s in summaries if s.report is None and not s.planned_nothing]
    if missing:
        closing.error = f"--chunk-offload-report {report_path}: no report: rank {missing[0].rank}: {missing[0].report_error}"
        return "report: not written (see the error below)"
    reports = sorted((s.report for s in summaries if s.report is not None), key=lambda r: r.rank)
    try:
        closing.files = write_report(reports, report_path)
    except (OSError, ChunkOffloadError) as e:
        closing.error = f"--chunk-offload-report {report_path}: could not write the report: {e}"
        return "report: not written (see the error below)"
    files = closing.files
    written = ", ".join(str(f) for f in (files.json, files.table, files.png) if f is not None)
    return f"report: {written}" + ("" if files.png is not None else " (no PNG: see the warning above)")


def _title(summaries: list[StageSummary]) -> str:
    modules = ",".join(dict.fromkeys(name for s in summaries for name in s.requested))  # per stage under a plan
    calls = max(s.training_calls for s in summaries)
    return f"chunk-offload summary: --chunk-offload-modules {modules}, the last of {calls} training iterations, per rank"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))
