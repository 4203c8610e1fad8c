"""`plot_memory`: a PNG of the measure over one iteration per stage, without and with offload.

matplotlib is an optional extra (``plot``); it is imported only here, when a plot is drawn, and
through `matplotlib.figure.Figure` alone, so no pyplot state or GUI backend is touched.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Sequence

from ..core.errors import ChunkOffloadError
from .stage import StageReport

__all__ = ["missing_plot_package", "plot_memory"]

_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B"))


def missing_plot_package() -> str | None:
    """The name of the package the plot needs and cannot import (``"matplotlib"``), or None."""
    try:
        for name in ("matplotlib", "matplotlib.figure"):  # the package too: its submodule may be imported already
            importlib.import_module(name)
    except ImportError as e:
        return (e.name or "matplotlib").split(".")[0]
    return None


def plot_memory(reports: Sequence[StageReport], path: str | Path, *, dpi: int = 110) -> Path:
    """Draw one panel per rank: the measure after each accounting change of the baseline
    iteration and of the offload iteration, with their peaks (and the device budget, if any),
    and save it as a PNG at ``path``.

    The x axis is the fraction of the iteration's accounting changes: the offload iteration has
    more of them (every copy is one), so both lines span the same width.
    """
    missing = missing_plot_package()
    if missing:
        raise ChunkOffloadError(
            f"plotting the stage report needs {missing}: pip install 'chunk-offload[plot]' (or pip install matplotlib)"
        )
    from matplotlib.figure import Figure
    reports = list(reports)
    if not reports:
        raise ChunkOffloadError("no stage reports to plot; pass the list gather_reports returned on rank 0")
    top = max(max(r.peak_without, r.peak_with, *r.trace_without, *r.trace_with, _budget(r) or 0, 1) for r in reports)
    scale, unit = next((s, u) for s, u in _UNITS if top >= s)
    figure = Figure(figsize=(8.0, 1.0 + 2.2 * len(reports)), layout="constrained")
    axes = figure.subplots(len(reports), 1, squeeze=False, sharex=True)[:, 0]
    for ax, report in zip(axes, reports):
        for trace, peak, label, color in (
            (report.trace_without, report.peak_without, "without offload", "tab:red"),
            (report.trace_with, report.peak_with, "with offload", "tab:blue"),
        ):
            if trace:
                steps = max(len(trace) - 1, 1)
                ax.step([i / steps for i in range(len(trace))], [b / scale for b in trace], where="post", color=color, label=f"{label} (peak {peak / scale:.1f} {unit})")
            ax.axhline(peak / scale, color=color, linestyle=":", linewidth=0.8)
        budget = _budget(report)
        if budget is not None:
            ax.axhline(budget / scale, color="tab:green", linestyle="--", linewidth=1.0, label=f"device budget {budget / scale:.1f} {unit}")
        ratio = "-" if report.ratio is None else f"{report.ratio:.2%}"
        ax.set_title(
            f"rank {report.rank}, pipeline stage {report.pp_rank}/{report.pp_size}, {report.vp_size} virtual: "
            f"drop {report.measured_drop / scale:.1f} of {report.theoretical_drop / scale:.1f} {unit} (R {ratio})",
            fontsize=9,
        )
        ax.set_ylabel(unit)
        highest = max(report.peak_without, report.peak_with, *report.trace_without, *report.trace_with, budget or 0, 1)
        ax.set_ylim(0, 1.3 * highest / scale)  # headroom for the legend above the peaks
        ax.legend(loc="upper right", fontsize=8, ncols=2)
    axes[-1].set_xlabel("progress through one iteration (fraction of accounting changes)")
    measures = ", ".join(dict.fromkeys(r.measure for r in reports))
    figure.suptitle(f"device-resident memory per stage ({measures})", fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=dpi)
    return path


def _budget(report: StageReport) -> int | None:
    """The rank's device budget in bytes (the levelled one for ``"auto"``), or None."""
    return report.leveled_budget if report.device_budget == "auto" else report.device_budget
