"""The per-stage report from a real megatron-core run: PP=2, VPP=2 on 2 gloo CPU ranks.

One spawn (module fixture) trains with every dense module offloaded, the first iteration as the
baseline, and in the ranks builds each report (`manager.report()`), gathers them to rank 0 and
writes the table, JSON and PNG there. The tests check those against the manager's own
records: on CPU the measure is the accounting the plan's simulation mirrors, so the measured
drop equals the theoretical drop exactly (R == 1.0).
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.integrations.megatron import add_arguments, attach_from_args
from chunk_offload.integrations.megatron import from_args as args_module
from chunk_offload.integrations.megatron.reporting import build_stage_report
from chunk_offload.report import MEASURES, format_table, read_json

from tests._megatron import Hooks, Run, TinyGPTConfig, spawn_runs
from tests._megatron_offload import OffloadHooks

_NO_MEGATRON = importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None
_DENSE = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1")
_CONFIG = TinyGPTConfig(pipeline_parallel=2, virtual_pipeline=2, iterations=3)
_WORLD = 2
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class _ReportHooks(OffloadHooks):
    """Attach with a baseline iteration; after training, report, gather and write on rank 0."""

    out_dir: str = ""

    def report(self, chunks: list[torch.nn.Module]) -> dict[str, Any]:
        from chunk_offload.report import gather_reports, write_report
        from chunk_offload.schedule import simulate

        manager = self.manager
        mine = manager.report()
        gathered = gather_reports(mine)
        files = write_report(gathered, Path(self.out_dir) / "report") if gathered is not None else None
        manager.close()
        return {
            "report": mine,
            "gathered": gathered,
            "files": files,
            "records": list(manager.records),
            "plan": manager.plan,
            # simulate(plan, bytes).drop with the policy the last iteration ran, computed where that
            # policy lives, holding on device what that iteration kept because another reference
            # holds it (NOTE [Storages held elsewhere]).
            "simulated_drop": simulate(
                manager.plan,
                lambda m, v: manager.records[0].group_bytes[(m, v)],
                policy=manager.tracking.ran_policy,
                kept_bytes=manager.records[-1].kept_bytes_of,
            ).drop,
        }


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> list[dict[str, Any]]:
    if _NO_MEGATRON:
        pytest.skip('megatron-core is not installed (pip install "chunk-offload[megatron]")')
    out_dir = tmp_path_factory.mktemp("report")
    hooks = _ReportHooks(_DENSE, options={"min_offload_bytes": 1, "baseline_iterations": 1, "trace": True}, out_dir=str(out_dir))
    run = Run(config=_CONFIG, hooks=Hooks(wrap_model=hooks.wrap_model, wrap_forward_backward=hooks.wrap_forward_backward, report=hooks.report))
    (results,) = spawn_runs([run], world_size=_WORLD, timeout_s=180.0)
    return [r.extra for r in results]


def test_records_are_the_baseline_then_the_last_iteration(spawned):
    for extra in spawned:
        assert [r.offload for r in extra["records"]] == [False, True]
        report = extra["report"]
        assert (report.baseline_iteration, report.offload_iteration) == (0, _CONFIG.iterations - 1)


def test_report_numbers_are_the_records(spawned):
    for rank, extra in enumerate(spawned):
        report, records = extra["report"], extra["records"]
        baseline, offloaded = records[0], records[-1]
        assert report.rank == rank and report.measure == "cpu_saved_bytes_accounting"
        assert (report.pp_rank, report.pp_size, report.vp_size) == (extra["plan"].pp_rank, 2, 2)
        assert report.peak_without == baseline.peak_resident_bytes == baseline.peak_saved_bytes
        assert report.peak_with == offloaded.peak_resident_bytes
        assert report.trace_without == baseline.resident_trace and report.trace_with == offloaded.resident_trace
        assert max(report.trace_without) == report.peak_without and max(report.trace_with) == report.peak_with
        assert report.bytes_per_module == {n: g.bytes_offloaded for n, g in offloaded.groups.items()}
        # The default groups, bounded layer groups: a tiny layer's six modules stay under the bound
        # and form one group, named by them in call order.
        assert set(report.bytes_per_module) == {"+".join(_DENSE)} and all(b > 0 for b in report.bytes_per_module.values())
        assert report.copy_ms == sum(g.offload_time_s + g.reload_time_s for g in offloaded.groups.values()) * 1e3
        assert report.wait_ms == sum(g.wait_time_s for g in offloaded.groups.values()) * 1e3


def test_measured_drop_equals_theoretical_drop_exactly(spawned):
    for extra in spawned:
        report, records = extra["report"], extra["records"]
        assert report.theoretical_drop > 0
        assert report.measured_drop == report.theoretical_drop and report.ratio == 1.0
        # The simulation predicts both peaks, not only their difference.
        assert report.predicted_peak_without == records[0].peak_saved_bytes == report.peak_without
        assert report.predicted_peak_with == records[-1].peak_resident_bytes == report.peak_with
        # Dense layers save the same bytes every iteration: the drop is the plan's simulated drop.
        baseline = records[0]
        assert baseline.group_bytes == records[-1].group_bytes
        assert report.theoretical_drop == extra["simulated_drop"]


def test_the_plan_is_the_schedule_that_ran(spawned):
    for extra in spawned:
        plan = extra["plan"]
        assert plan.diff(extra["records"][-1].order) is None


def test_the_first_stage_holds_and_saves_more(spawned):
    """Interleaved 1F1B keeps more chunks in flight on stage 0 than on stage 1."""
    first, last = (extra["report"] for extra in spawned)
    assert first.pp_rank == 0 and last.pp_rank == 1
    assert first.peak_without > last.peak_without and first.theoretical_drop > last.theoretical_drop


def test_rank_zero_gathers_one_table_row_per_rank(spawned):
    gathered = spawned[0]["gathered"]
    assert spawned[1]["gathered"] is None and spawned[1]["files"] is None
    assert gathered == [extra["report"] for extra in spawned]
    table = format_table(gathered)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("|")][2:]
    assert [(row[0], row[1]) for row in rows] == [("0", "0/2"), ("1", "1/2")]
    assert all(row[7] == "100.00%" for row in rows)
    assert f"memory measure: cpu_saved_bytes_accounting ({MEASURES['cpu_saved_bytes_accounting']})" in table
    assert spawned[0]["files"].table.read_text() == table + "\n"


def test_json_round_trips_to_the_reports(spawned):
    assert read_json(spawned[0]["files"].json) == [extra["report"] for extra in spawned]


def test_png_is_a_valid_image(spawned):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    png = spawned[0]["files"].png
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    image = imread(png)
    assert image.ndim == 3 and image.shape[0] > 0 and image.shape[1] > 0


# --------------------------------------------------------------------------------------------
# Without a run: the flags and the errors.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("report", [None, "out/report"])
def test_report_flag_adds_a_baseline_iteration_and_tracing(monkeypatch, report):
    seen = {}
    monkeypatch.setattr(args_module, "attach", lambda model, modules, **config: seen.update(config) or "manager")
    argv = ["--chunk-offload-modules", "core_attn"] + (["--chunk-offload-report", report] if report else [])
    args = add_arguments(argparse.ArgumentParser()).parse_args(argv)
    assert attach_from_args(torch.nn.Linear(1, 1), args) == "manager"
    if report:
        assert seen["baseline_iterations"] == 1 and seen["config"].trace is True
    else:
        assert seen["baseline_iterations"] == 0 and seen["config"].trace is False


def _record(offload: bool) -> SimpleNamespace:
    return SimpleNamespace(offload=offload)


@pytest.mark.parametrize(
    "offloads, plan, match",
    [
        ([True, True], object(), r"all 2 recorded iterations ran with offload; attach with baseline_iterations=1"),
        ([False, False], object(), r"all 2 recorded iterations were baselines; train more iterations than baseline_iterations"),
        ([], object(), r"all 0 recorded iterations ran with offload"),
        ([False], object(), r"all 1 recorded iterations were baselines"),
        ([False, True], None, r"the manager has no plan yet: run a training iteration first \(through manager.wrap\(...\), or with iterations='auto'\)"),
    ],
    ids=["no_baseline", "no_offload", "no_records", "only_baseline", "no_plan"],
)
def test_build_stage_report_says_what_is_missing(offloads, plan, match):
    manager = SimpleNamespace(records=[_record(o) for o in offloads], plan=plan, schedule_policy=None, training_calls=len(offloads))
    with pytest.raises(ChunkOffloadError, match=match):
        build_stage_report(manager)


# ----------------------------------------------------------------------------- ranks that copied nothing


def _nothing_copied(rank: int, *, tracked: int) -> Any:
    """A rank's report whose offload iteration copied no byte; ``tracked``: its predicted peak without offload."""
    from dataclasses import replace

    from tests.report._reports import sample_report

    noise = 896  # with MoE the two iterations' peaks differ by the routing
    return replace(
        sample_report(rank),
        bytes_per_module={"core_attn": 0, "expert_fc1": 0},
        peak_without=tracked + noise,
        peak_with=tracked,
        predicted_peak_without=tracked,
        predicted_peak_with=tracked - noise,
        theoretical_drop=noise,
    )


def test_table_marks_ranks_that_copied_nothing_and_says_why() -> None:
    from tests.report._reports import sample_report

    reports = [sample_report(0), _nothing_copied(1, tracked=28800), _nothing_copied(2, tracked=0), _nothing_copied(3, tracked=0)]
    table = format_table(reports)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("|")][2:]
    assert rows[0][5] == str(reports[0].measured_drop) and rows[0][7] == f"{reports[0].ratio:.2%}"
    for row in rows[1:]:  # no drop and no R from noise
        assert row[5:8] == ["-", "-", "-"], row
    assert "rank 1 copied nothing: the plan kept every chunk on device" in table
    assert "ranks 2, 3 copied nothing: no saved tensor of the offloaded modules reached min_offload_bytes" in table
    assert "--chunk-offload-min-offload-bytes" in table
    assert "copied nothing" not in format_table([sample_report(0)])
