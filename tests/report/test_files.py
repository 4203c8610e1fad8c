"""`write_report`: one path names the JSON, the PNG and the Markdown table."""

from __future__ import annotations

import sys

import pytest

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.report import format_table, read_json, report_files, write_report

from ._reports import sample_report


@pytest.mark.parametrize("given", ["out/report", "out/report.json", "out/report.png", "out/report.md"])
def test_one_prefix_names_all_files(tmp_path, given):
    files = report_files(tmp_path / given)
    assert (files.json, files.png, files.table) == tuple(tmp_path / "out" / f"report{s}" for s in (".json", ".png", ".md"))


def test_a_dotted_name_keeps_its_dot(tmp_path):
    assert report_files(tmp_path / "pp2.vpp2").json == tmp_path / "pp2.vpp2.json"


def test_write_report_writes_all_three(tmp_path):
    pytest.importorskip("matplotlib")
    reports = [sample_report(0), sample_report(1)]
    files = write_report(reports, tmp_path / "run" / "report")
    assert read_json(files.json) == reports
    assert files.table.read_text() == format_table(reports) + "\n"
    assert files.png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_plot_or_matplotlib_the_table_and_json_are_still_written(tmp_path, monkeypatch):
    reports = [sample_report(0)]
    files = write_report(reports, tmp_path / "a", plot=False)
    assert files.json.exists() and files.table.exists() and not files.png.exists()
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ChunkOffloadError, match=r"chunk-offload\[plot\]"):
        write_report(reports, tmp_path / "b")
    assert read_json(tmp_path / "b.json") == reports and not (tmp_path / "b.png").exists()
