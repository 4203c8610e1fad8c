"""Text and JSON forms of the gathered `StageReport` list: one table with a row per rank, and a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from ..core.actions import NOTATION
from ..core.errors import ChunkOffloadError
from .stage import MEASURES, StageReport

__all__ = ["FORMAT", "format_table", "from_json", "read_json", "table_lines", "to_json", "write_json"]

FORMAT = "chunk_offload.stage_reports/1"
"""The ``format`` field of the JSON document; bumped when fields change meaning."""

# NOTE [Ranks that copied nothing]
# A rank whose offload iteration copied no byte has no drop from offload; a difference between its
# two peaks is something else (with MoE: the routing, which changes the saved bytes per iteration).
# Its drop and R cells show "-", and a line below the table says why nothing was copied, from what
# the report holds: no saved byte of the offloaded modules was tracked at all (predicted peak
# without offload 0: every tensor below min_offload_bytes, or the modules saved nothing), or
# bytes were tracked but the plan kept every chunk on device (its backward follows at once), or
# the rank's peak fits its device budget (the budget's choice offloads nothing).

_RANK_COLUMNS = (
    # header, alignment (markdown), cell
    ("rank", "r", lambda r: str(r.rank)),
    ("pp", "r", lambda r: f"{r.pp_rank}/{r.pp_size}"),
)
_COLUMNS = (
    *_RANK_COLUMNS,
    ("vp", "r", lambda r: str(r.vp_size)),
    ("peak without (B)", "r", lambda r: str(r.peak_without)),
    ("peak with (B)", "r", lambda r: str(r.peak_with)),
    # A rank that copied nothing has no drop to show: see NOTE [Ranks that copied nothing].
    ("measured drop (B)", "r", lambda r: "-" if _copied_nothing(r) else str(r.measured_drop)),
    ("theoretical drop (B)", "r", lambda r: "-" if _copied_nothing(r) else str(r.theoretical_drop)),
    ("R", "r", lambda r: "-" if r.ratio is None or _copied_nothing(r) else f"{r.ratio:.2%}"),
    ("copy ms", "r", lambda r: f"{r.copy_ms:.2f}"),
    ("wait ms", "r", lambda r: f"{r.wait_ms:.2f}"),
    ("bytes offloaded per module", "l", lambda r: ",".join(f"{n}:{b}" for n, b in r.bytes_per_module.items()) or "-"),
)


# The budgets, in a second table shown when a rank has one (NOTE [Device budget] in integrations/budgets.py).
_BUDGET_COLUMNS = (
    *_RANK_COLUMNS,
    ("device budget (B)", "r", lambda r: _or_dash(r.device_budget)),
    ("levelled (B)", "r", lambda r: _or_dash(r.leveled_budget)),
    ("predicted peak (B)", "r", lambda r: str(r.predicted_peak_with)),
    ("peak with (B)", "r", lambda r: str(r.peak_with)),
    ("fits", "l", lambda r: "-" if r.budget_fits is None else ("yes" if r.budget_fits else "NO (lowest peak)")),
    ("groups offloaded per module", "l", lambda r: ",".join(f"{n}:{k}" for n, k in r.offloaded_groups.items()) or "none"),
    ("host cap (B)", "r", lambda r: _or_dash(r.host_cap)),
    ("node host budget (B)", "r", lambda r: _or_dash(r.host_budget)),
)


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def format_table(reports: Sequence[StageReport]) -> str:
    """The reports as one table, a row per rank (a Markdown table that also reads as plain text).

    Above the table: the measure the peaks use and what it means, and which iterations were
    compared. R is the measured drop over the theoretical drop (NOTE [Report measure]). The last
    line points to the glossary of the columns and notations (`NOTATION`).
    """
    reports = _checked(reports)
    lines = [f"memory measure: {m} ({MEASURES[m]})" for m in dict.fromkeys(r.measure for r in reports)]
    pairs = dict.fromkeys((r.baseline_iteration, r.offload_iteration) for r in reports)
    for base, offload in pairs:
        if base is not None and offload is not None:
            lines.append(f"peak without: iteration {base + 1} (baseline, nothing copied); peak with: iteration {offload + 1} (offload)")
    lines += ["", *table_lines(_COLUMNS, reports)]  # a blank line: Markdown needs it before a table
    lines += _nothing_copied_notes(reports)
    lines += _difference_notes(reports)
    if any(r.device_budget is not None or r.host_budget is not None for r in reports):
        lines += ["", "budgets (predicted peak: simulate's, under the budget's choice; peak with: measured):", ""]
        lines += table_lines(_BUDGET_COLUMNS, reports)
    lines += ["", NOTATION]
    return "\n".join(lines)


def table_lines(columns: Sequence[tuple[str, str, Callable[[Any], str]]], rows: Sequence[Any]) -> list[str]:
    """The lines of a Markdown table (that also reads as plain text) with a line per row.

    ``columns``: ``(header, alignment, cell)`` each, alignment ``"r"`` or ``"l"``, ``cell(row)`` the text.
    """
    cells = [[header for header, _, _ in columns]] + [[cell(r) for _, _, cell in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]

    def row(values: list[str]) -> str:
        padded = (v.rjust(w) if align == "r" else v.ljust(w) for v, w, (_, align, _) in zip(values, widths, columns))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if align == "r" else (":" + "-" * (w + 1)) for w, (_, align, _) in zip(widths, columns)) + "|"
    return [row(cells[0]), rule, *(row(c) for c in cells[1:])]


def _copied_nothing(report: StageReport) -> bool:
    return not any(report.bytes_per_module.values())


def _nothing_copied_notes(reports: list[StageReport]) -> list[str]:
    """One line per reason for the ranks that copied nothing. See NOTE [Ranks that copied nothing]."""
    below = [r.rank for r in reports if _copied_nothing(r) and r.predicted_peak_without == 0]
    fit = [r.rank for r in reports if _copied_nothing(r) and r.predicted_peak_without > 0 and r.budget_fits and not r.offloaded_groups]
    kept = [r.rank for r in reports if _copied_nothing(r) and r.predicted_peak_without > 0 and r.rank not in fit]
    notes = []
    if below:
        notes.append(
            f"{_ranks(below)} copied nothing: no saved tensor of the offloaded modules reached min_offload_bytes "
            "(--chunk-offload-min-offload-bytes, default 1 MiB); a small model needs a lower threshold"
        )
    if fit:
        notes.append(f"{_ranks(fit)} copied nothing: the peak without offload fits the device budget (see the budgets below)")
    if kept:
        notes.append(
            f"{_ranks(kept)} copied nothing: the plan kept every chunk on device (each backward follows its forward "
            "at once); a change of their peaks is not offload (with MoE: the routing)"
        )
    return ["", *notes] if notes else []


def _difference_notes(reports: list[StageReport]) -> list[str]:
    """What the theory leaves out, per rank, each on its own line (docs/report.md, "What the theory counts")."""
    notes = [
        f"rank {r.rank}: {r.kept_held_elsewhere_bytes} B kept on device, held by another reference (a copy frees "
        "nothing; not in the theoretical drop)"
        for r in reports
        if r.kept_held_elsewhere_bytes
    ]
    notes += [
        f"rank {r.rank}: measured - theoretical drop = {r.measured_drop - r.theoretical_drop} B: device memory outside "
        "the saved bytes of the offloaded modules at the two peaks (temporaries, allocator rounding)"
        for r in reports
        if r.measure == "cuda_max_memory_allocated" and not _copied_nothing(r)
    ]
    return ["", *notes] if notes else []


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def to_json(reports: Sequence[StageReport]) -> str:
    """The reports as a JSON document: ``{"format", "measures", "reports": [...]}`` (strict JSON, no NaN)."""
    reports = _checked(reports)
    document = {
        "format": FORMAT,
        "measures": {m: MEASURES[m] for m in dict.fromkeys(r.measure for r in reports)},
        "reports": [r.to_dict() for r in reports],
    }
    return json.dumps(document, indent=1, allow_nan=False)


def from_json(text: str) -> list[StageReport]:
    """The reports of a document written by `to_json`."""
    try:
        document: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise ChunkOffloadError(f"stage report JSON does not parse: {e}") from e
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ChunkOffloadError(f"not a stage report document: format {found!r}, expected {FORMAT!r}")
    return [StageReport.from_dict(item) for item in document["reports"]]


def write_json(reports: Sequence[StageReport], path: str | Path) -> Path:
    """Write `to_json` to ``path`` (parent directories are created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(reports) + "\n")
    return path


def read_json(path: str | Path) -> list[StageReport]:
    """The reports in a file written by `write_json`."""
    return from_json(Path(path).read_text())


def _checked(reports: Sequence[StageReport]) -> list[StageReport]:
    reports = list(reports)
    if not reports:
        raise ChunkOffloadError("no stage reports to render; pass the list gather_reports returned on rank 0")
    bad = [type(r).__name__ for r in reports if not isinstance(r, StageReport)]
    if bad:
        raise ChunkOffloadError(f"expected StageReport objects, got {bad}; build them with build_stage_report / stage_report")
    return reports
