"""The per-stage memory report: peak without and with offload, the plan's theoretical drop, R.

Build one `StageReport` per rank (`stage_report`, or ``manager.report()`` of the Megatron
integration), collect them on rank 0 with the explicit collective `gather_reports`, then
render them: `format_table`, `to_json` / `write_json`, `plot_memory`, or all three with
`write_report`. See NOTE [Report measure] in `stage.py` for what the peaks count.
"""

from .files import ReportFiles, report_files, write_report
from .gather import gather_objects, gather_reports
from .plot import plot_memory
from .render import FORMAT, format_table, from_json, read_json, to_json, write_json
from .stage import MEASURES, Measure, StageReport, stage_report

__all__ = [
    "FORMAT",
    "MEASURES",
    "Measure",
    "ReportFiles",
    "StageReport",
    "format_table",
    "from_json",
    "gather_objects",
    "gather_reports",
    "plot_memory",
    "read_json",
    "report_files",
    "stage_report",
    "to_json",
    "write_json",
    "write_report",
]
