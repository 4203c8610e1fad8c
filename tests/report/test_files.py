"""`write_report`: one path names the JSON, the PNG and the Markdown table."""

from __future__ import annotations

import sys

import pytest

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.report import format_table, plot_memory, read_json, report_files, write_report

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


def test_without_plot_the_table_and_json_are_still_written(tmp_path):
    reports = [sample_report(0)]
    files = write_report(reports, tmp_path / "a", plot=False)
    assert files.json.exists() and files.table.exists() and files.png is None
    assert not (tmp_path / "a.png").exists()


@pytest.mark.parametrize("blocked", ["matplotlib", "matplotlib.figure"])
def test_without_matplotlib_the_plot_is_skipped_with_one_warning_line(tmp_path, monkeypatch, caplog, blocked):
    """The plot is optional: a missing matplotlib is a warning naming it and the PNG skipped, not an error."""
    reports = [sample_report(0)]
    monkeypatch.setitem(sys.modules, blocked, None)  # `import matplotlib...` raises ImportError
    with caplog.at_level("WARNING", logger="chunk_offload.report.files"):
        files = write_report(reports, tmp_path / "b")
    assert files.png is None and not (tmp_path / "b.png").exists()
    assert read_json(files.json) == reports and files.table.read_text() == format_table(reports) + "\n"
    [record] = caplog.records
    message = record.getMessage()
    assert "\n" not in message and "matplotlib is not installed" in message and str(tmp_path / "b.png") in message
    with pytest.raises(ChunkOffloadError, match=r"chunk-offload\[plot\]"):  # an explicit plot still says what it needs
        plot_memory(reports, tmp_path / "c.png")
