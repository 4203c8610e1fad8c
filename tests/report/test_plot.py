"""`plot_memory` writes a PNG that matplotlib reads back; without matplotlib it names the extra."""

from __future__ import annotations

import sys

import pytest

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.report import plot_memory

from ._reports import sample_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_png_has_one_panel_per_rank_and_reads_back(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    one = plot_memory([sample_report(0)], tmp_path / "one.png")
    two = plot_memory([sample_report(0), sample_report(1)], tmp_path / "deeper" / "two.png")
    for path in (one, two):
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000
    small, tall = imread(one), imread(two)
    assert small.ndim == 3 and small.shape[1] == tall.shape[1]
    assert tall.shape[0] > small.shape[0]  # the second rank adds a panel


def test_empty_traces_still_plot(tmp_path):
    pytest.importorskip("matplotlib")
    report = sample_report(0)
    report.trace_with = []
    assert plot_memory([report], tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC


def test_missing_matplotlib_names_the_plot_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    with pytest.raises(ChunkOffloadError, match=r"needs matplotlib: pip install 'chunk-offload\[plot\]'"):
        plot_memory([sample_report(0)], tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()


def test_no_reports_to_plot(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ChunkOffloadError, match="no stage reports to plot"):
        plot_memory([], tmp_path / "p.png")
