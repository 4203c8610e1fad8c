"""The budget fields of a `StageReport`: the second table, the notes, the JSON round trip."""

from __future__ import annotations

from dataclasses import replace

import pytest

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.report import format_table, from_json, to_json

from ._reports import sample_report


def _budgeted(rank: int, *, fits_without: bool) -> object:
    report = sample_report(rank)
    if fits_without:  # nothing offloaded: the peak without offload fits the budget
        report = replace(report, peak_with=report.peak_without, predicted_peak_with=report.peak_without,
                         theoretical_drop=0, bytes_per_module={"core_attn": 0})
    return replace(
        report,
        device_budget=report.peak_without if fits_without else report.peak_with,
        offloaded_groups={} if fits_without else {"core_attn": 3, "qkv_linear": 1},
        budget_fits=True,
        host_budget=1 << 20,
        host_cap=0 if fits_without else 1 << 19,
    )


def _budget_rows(table: str) -> list[list[str]]:
    part = table.split("budgets (", 1)[1]
    return [[c.strip() for c in line.strip("|").split("|")] for line in part.splitlines() if line.startswith("|")]


def test_without_budgets_there_is_no_budget_table():
    assert "budgets (" not in format_table([sample_report(0), sample_report(1)])


def test_budget_table_has_a_row_per_rank():
    reports = [_budgeted(0, fits_without=False), _budgeted(1, fits_without=True)]
    table = format_table(reports)
    header, _, *body = _budget_rows(table)
    assert header == [
        "rank", "pp", "device budget (B)", "levelled (B)", "predicted peak (B)", "peak with (B)", "fits",
        "groups offloaded per module", "host cap (B)", "node host budget (B)",
    ]
    for report, row in zip(reports, body, strict=True):
        values = dict(zip(header, row))
        assert int(values["device budget (B)"]) == report.device_budget and values["levelled (B)"] == "-"
        assert (int(values["predicted peak (B)"]), int(values["peak with (B)"])) == (report.predicted_peak_with, report.peak_with)
        assert int(values["host cap (B)"]) == report.host_cap and int(values["node host budget (B)"]) == 1 << 20
    assert body[0][7] == "core_attn:3,qkv_linear:1" and body[1][7] == "none"
    assert "rank 1 copied nothing: the peak without offload fits the device budget" in table
    assert "the plan kept every chunk on device" not in table


def test_auto_and_an_infeasible_budget_read_as_such():
    report = replace(_budgeted(0, fits_without=False), device_budget="auto", leveled_budget=1234, budget_fits=False)
    row = _budget_rows(format_table([report]))[2]
    assert (row[2], row[3], row[6]) == ("auto", "1234", "NO (lowest peak)")


def test_budget_fields_round_trip_through_json():
    reports = [_budgeted(0, fits_without=False), replace(_budgeted(1, fits_without=True), device_budget="auto", leveled_budget=99)]
    assert from_json(to_json(reports)) == reports


def test_stage_report_refuses_unknown_budget_fields():
    from chunk_offload.report import stage_report

    with pytest.raises(ChunkOffloadError, match=r"unknown budget fields \['device_budget_gb'\]"):
        stage_report(baseline=None, offloaded=None, plan=None, rank=0, budgets={"device_budget_gb": 1})


def test_plot_draws_the_budget_line(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from chunk_offload.report import plot_memory

    labels: list[str] = []
    original = Axes.axhline

    def axhline(self, y=0, *args, **kwargs):
        labels.append(kwargs.get("label"))
        return original(self, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "axhline", axhline)
    reports = [_budgeted(0, fits_without=False), replace(_budgeted(1, fits_without=True), device_budget="auto", leveled_budget=3 << 10)]
    plot_memory(reports, tmp_path / "budget.png")
    expected = [reports[0].device_budget / 1024, reports[1].leveled_budget / 1024]  # the sample reports plot in KiB
    assert [label for label in labels if label] == [f"device budget {kib:.1f} KiB" for kib in expected]
