"""The table (one row per rank, PR 1752's shape) and the JSON document."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.report import FORMAT, MEASURES, format_table, from_json, read_json, to_json, write_json

from ._reports import sample_report


def _rows(table: str) -> list[list[str]]:
    lines = [line for line in table.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_table_has_a_header_a_rule_and_one_row_per_rank():
    reports = [sample_report(r, pp_size=2) for r in range(4)]  # DP=2 x PP=2: pp ranks 0 1 0 1
    table = format_table(reports)
    rows = _rows(table)
    header, rule, body = rows[0], rows[1], rows[2:]
    assert header[:8] == ["rank", "pp", "vp", "peak without (B)", "peak with (B)", "measured drop (B)", "theoretical drop (B)", "R"]
    assert all(set(cell) <= set("-:") for cell in rule)
    assert [row[0] for row in body] == ["0", "1", "2", "3"]
    assert [row[1] for row in body] == ["0/2", "1/2", "0/2", "1/2"]
    for report, row in zip(reports, body):
        values = dict(zip(header, row))
        assert int(values["peak without (B)"]) == report.peak_without
        assert int(values["peak with (B)"]) == report.peak_with
        assert int(values["measured drop (B)"]) == report.measured_drop
        assert int(values["theoretical drop (B)"]) == report.theoretical_drop
        assert values["R"] == f"{report.ratio:.2%}"
        assert values["bytes offloaded per module"] == ",".join(f"{n}:{b}" for n, b in report.bytes_per_module.items())
    # Columns line up: every table line has the same length.
    assert len({len(line) for line in table.splitlines() if line.startswith("|")}) == 1


def test_table_names_its_measure_and_the_iterations_compared():
    table = format_table([sample_report(0)])
    assert f"memory measure: cpu_saved_bytes_accounting ({MEASURES['cpu_saved_bytes_accounting']})" in table
    assert "peak without: iteration 1 (baseline, nothing copied); peak with: iteration 3 (offload)" in table
    cuda = format_table([sample_report(0, measure="cuda_max_memory_allocated")])
    assert "memory measure: cuda_max_memory_allocated (torch.cuda.max_memory_allocated" in cuda


def test_table_shows_a_dash_when_no_drop_is_predicted():
    report = replace(sample_report(0), theoretical_drop=0, bytes_per_module={})
    row = _rows(format_table([report]))[2]
    assert row[7] == "-" and row[-1] == "-"


@pytest.mark.parametrize("bad, match", [([], "no stage reports to render"), ([{"rank": 0}], r"expected StageReport objects, got \['dict'\]")])
def test_table_and_json_refuse_bad_input(bad, match):
    with pytest.raises(ChunkOffloadError, match=match):
        format_table(bad)
    with pytest.raises(ChunkOffloadError, match=match):
        to_json(bad)


def test_json_round_trips_and_is_strict(tmp_path):
    reports = [sample_report(0), replace(sample_report(1), theoretical_drop=0)]
    text = to_json(reports)
    document = json.loads(text)
    assert document["format"] == FORMAT
    assert document["measures"] == {"cpu_saved_bytes_accounting": MEASURES["cpu_saved_bytes_accounting"]}
    assert [d["rank"] for d in document["reports"]] == [0, 1]
    assert document["reports"][1]["R"] is None  # null, not NaN: strict JSON
    assert from_json(text) == reports
    path = write_json(reports, tmp_path / "sub" / "report.json")
    assert read_json(path) == reports


def test_from_json_names_what_it_got():
    with pytest.raises(ChunkOffloadError, match=r"format 'other/1', expected 'chunk_offload.stage_reports/1'"):
        from_json(json.dumps({"format": "other/1", "reports": []}))
    with pytest.raises(ChunkOffloadError, match=r"format 'list', expected"):
        from_json("[]")
    with pytest.raises(ChunkOffloadError, match="stage report JSON does not parse"):
        from_json("{")


def test_table_names_what_the_theory_leaves_out_per_rank():
    """Bytes kept on device because another reference holds them, and on CUDA the measured drop
    beyond the theory, each on its own line (docs/report.md, "What the theory counts")."""
    held = replace(sample_report(0), kept_held_elsewhere_bytes=4096)
    cuda = replace(sample_report(1, measure="cuda_max_memory_allocated"), peak_with=sample_report(1).peak_with + 512)
    table = format_table([held, cuda])
    assert "rank 0: 4096 B kept on device, held by another reference (a copy frees nothing; not in the theoretical drop)" in table
    assert f"rank 1: measured - theoretical drop = {cuda.measured_drop - cuda.theoretical_drop} B: device memory outside" in table
    assert cuda.measured_drop - cuda.theoretical_drop == -512
    assert "rank 0: measured" not in table and "rank 1: 0 B kept" not in table
    assert from_json(to_json([held]))[0].kept_held_elsewhere_bytes == 4096
