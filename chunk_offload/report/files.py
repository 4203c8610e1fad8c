"""`write_report`: the gathered report as files, from one path (``--chunk-offload-report PATH``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from .plot import missing_plot_package, plot_memory
from .render import format_table, write_json
from .stage import StageReport

__all__ = ["ReportFiles", "report_files", "write_report"]

logger = logging.getLogger(__name__)

_SUFFIXES = (".json", ".png", ".md")


@dataclass(frozen=True, slots=True)
class ReportFiles:
    """Where `write_report` puts the report."""

    json: Path
    """The reports as JSON (`chunk_offload.report.read_json` reads it back)."""
    png: Path | None
    """The plot of `plot_memory` (`write_report`: None when it was not drawn)."""
    table: Path
    """The table of `format_table` (Markdown)."""


def report_files(path: str | Path) -> ReportFiles:
    """``PATH.json``, ``PATH.png`` and ``PATH.md``; a ``.json``, ``.png`` or ``.md`` suffix of
    ``path`` is dropped first, so ``out/report.json`` and ``out/report`` name the same files."""
    path = Path(path)
    if path.suffix in _SUFFIXES:
        path = path.with_suffix("")
    return ReportFiles(json=path.with_name(path.name + ".json"), png=path.with_name(path.name + ".png"), table=path.with_name(path.name + ".md"))


def write_report(reports: Sequence[StageReport], path: str | Path, *, plot: bool = True) -> ReportFiles:
    """Write the table, the JSON and (unless ``plot=False``) the PNG named by `report_files`.

    The plot is optional: it needs matplotlib (the ``plot`` extra), and without it the PNG is
    skipped with a one-line warning naming the package and the path. The returned files' ``png``
    is None when no PNG was written.
    """
    files = report_files(path)
    write_json(reports, files.json)
    files.table.write_text(format_table(reports) + "\n")
    missing = missing_plot_package() if plot else None
    if missing:
        logger.warning("chunk_offload: %s is not installed: skipped the plot %s (pip install 'chunk-offload[plot]')", missing, files.png)
    if not plot or missing:
        return replace(files, png=None)
    plot_memory(reports, files.png)
    return files
