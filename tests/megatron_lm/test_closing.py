"""The launcher's closing on rank 0: the summary per rank, why nothing was offloaded, and the report files.

`close_run` on hand-built `StageSummary` lists (with the hand-built reports of tests/report), and
`stage_summary` from real managers attached in this process to plain modules shaped like a GPTModel
chunk (megatron's pipeline state set to one stage).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from chunk_offload.core.actions import NOTATION
from chunk_offload.megatron_lm.closing import WAIT_HINT_SHARE, close_run, timed_reloads_line, wait_hint
from chunk_offload.megatron_lm.cli import _close
from chunk_offload.megatron_lm.summary import StageSummary, stage_summary, why_nothing
from chunk_offload.report import format_table, read_json
from tests.report._reports import sample_report

PROG = "python -m chunk_offload.megatron_lm"
MODULES = ["core_attn", "qkv_linear"]


def _summary(rank: int, **fields) -> StageSummary:
    """Rank ``rank`` of a PP=2 run that offloaded ``core_attn`` and ``qkv_linear`` (its report's bytes)."""
    report = sample_report(rank)
    values = dict(
        rank=rank, requested=list(MODULES), attached=True, pp_rank=rank % 2, pp_size=2,
        registered={"core_attn": 2, "qkv_linear": 2}, groups={"core_attn": 8, "qkv_linear": 8}, training_calls=3,
        offload=True, bytes_per_module=dict(report.bytes_per_module), saved_peak_bytes=report.peak_without,
        peak_bytes=report.peak_with, measure=report.measure, wait_ms=report.wait_ms, min_offload_bytes=0, report=report,
    )  # fmt: skip
    values.update(fields)
    return StageSummary(**values)


def test_the_summary_has_a_row_per_rank_and_says_where_the_report_is(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    summaries = [_summary(1, requested=[*MODULES, "expert_fc1"]), _summary(0, requested=[*MODULES, "expert_fc1"])]
    closing = close_run(summaries, report_path=str(tmp_path / "out" / "r"))
    assert closing.error is None and closing.warnings == []
    lines = closing.summary.splitlines()
    assert lines[0] == "chunk-offload summary: --chunk-offload-modules core_attn,qkv_linear,expert_fc1, the last of 3 training iterations, per rank"
    assert lines[1] == "device peak: on CPU, the manager's accounting of device-resident saved bytes of the offloaded modules"
    assert lines[3].split("|")[1:-1] == [
        " rank ", "  pp ", " offloaded per iteration (B) ", " device peak (B) ", " measured drop (B) ", "       R ", " wait ms ",
        " offloaded per module (B)         ",
    ]  # fmt: skip
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[5:7]]
    assert rows == [
        ["0", "0/2", "40960", "12288", "12288", "100.00%", "0.00", "core_attn:24576,qkv_linear:16384"],
        ["1", "1/2", "20480", "6144", "6144", "100.00%", "0.25", "core_attn:12288,qkv_linear:8192"],
    ]
    assert "--chunk-offload-modules expert_fc1 matches no submodule on ranks 0, 1: nothing of it is offloaded there" in lines
    assert lines[-2:] == [f"report: {tmp_path / 'out' / 'r.json'}, {tmp_path / 'out' / 'r.md'}, {tmp_path / 'out' / 'r.png'}", NOTATION]
    assert read_json(closing.files.json) == [sample_report(0), sample_report(1)]


def test_compute_waiting_on_copies_on_a_gpu_hints_at_timed_reload_ahead() -> None:
    """From `WAIT_HINT_SHARE` of the iteration on, on a GPU, without timed reload ahead: one line
    naming the ranks and the worst share; never on CPU streams (their waits are thread scheduling)."""
    cuda = dict(measure="cuda_max_memory_allocated", iteration_ms=400.0)
    at_share = WAIT_HINT_SHARE * 400.0
    summaries = [_summary(0, wait_ms=at_share, **cuda), _summary(1, wait_ms=74.0, **cuda), _summary(2, wait_ms=at_share - 0.1, **cuda)]
    assert wait_hint(summaries) == [
        "ranks 0, 1: compute waited on copies for up to 74.0 ms of a 400.0 ms iteration (18%, rank 1): where reloads lag "
        "the backward, --chunk-offload-timed-reload-ahead on starts each one early enough by the measured copy timing"
    ]
    assert wait_hint(summaries[1:2])[0] in close_run(summaries[1:2], report_path=None).summary.splitlines()
    assert wait_hint([_summary(1, wait_ms=74.0, timed_reload_ahead=True, **cuda)]) == []
    assert wait_hint([_summary(1, wait_ms=74.0, iteration_ms=400.0)]) == []  # the CPU accounting: no link to speak of
    assert wait_hint([_summary(1, wait_ms=74.0, offload=False, **cuda)]) == []  # a baseline iteration


def test_ranks_whose_reloads_follow_the_timing_are_named() -> None:
    """Their peak varies from run to run: the summary says which ranks and how to pin it; nothing
    where no rank timed its reloads (CPU streams by default) or a timed rank copied nothing."""
    summaries = [_summary(0, timed_reload_ahead=True), _summary(1), _summary(2, timed_reload_ahead=True, bytes_per_module={"core_attn": 0, "qkv_linear": 0})]
    line = ("rank 0: reloads start by the previous iteration's measured copy timing (timed reload ahead), so the device peak "
            "follows each run's timing; --chunk-offload-timed-reload-ahead off reloads one group ahead")  # fmt: skip
    assert timed_reloads_line(summaries) == [line]
    assert line in close_run(summaries, report_path=None).summary.splitlines()
    assert timed_reloads_line(summaries[1:]) == [] and "timed reload ahead" not in close_run(summaries[1:2], report_path=None).summary


def test_a_rank_that_copied_nothing_is_a_note_when_others_copied() -> None:
    summaries = [_summary(0), _summary(1, bytes_per_module={"core_attn": 0, "qkv_linear": 0}, report=None)]
    closing = close_run(summaries, report_path=None)
    assert closing.warnings == [] and closing.error is None
    assert (
        "rank 1 copied nothing: the plan kept every chunk on device: each chunk's backward follows its forward at once "
        "(the last pipeline stage without virtual stages, or PP=1)"
    ) in closing.summary.splitlines()
    assert closing.summary.endswith("report: none (--chunk-offload-report PATH adds the peak without offload, the measured drop and R)\n" + NOTATION)


_NOTHING = {"core_attn": 0, "qkv_linear": 0}


@pytest.mark.parametrize(
    "fields, warnings",
    [
        (
            dict(bytes_per_module=_NOTHING, saved_peak_bytes=0, min_offload_bytes=1 << 20),
            ["nothing was offloaded on ranks 0, 1: no saved tensor of core_attn,qkv_linear reached --chunk-offload-min-offload-bytes "
             "1048576 (default 1 MiB); a small model needs a lower threshold, e.g. --chunk-offload-min-offload-bytes 0"],
        ),
        (
            dict(requested=["expert_fc1"], registered={}, groups={}, bytes_per_module={}),
            ["--chunk-offload-modules expert_fc1 matches no submodule on ranks 0, 1: nothing of it is offloaded there",
             "nothing was offloaded on ranks 0, 1: no module of --chunk-offload-modules is in its model"],
        ),
        (
            dict(groups={"core_attn": 0, "qkv_linear": 0}, bytes_per_module=_NOTHING),
            ["nothing was offloaded on ranks 0, 1: core_attn,qkv_linear never ran in a training forward"],
        ),
        (dict(bytes_per_module=_NOTHING, baseline=True), ["nothing was offloaded on ranks 0, 1: --chunk-offload-baseline tracks the saved bytes but copies nothing"]),
        (dict(bytes_per_module=_NOTHING, budget_fits=True), ["nothing was offloaded on ranks 0, 1: its peak without offload fits --chunk-offload-device-budget"]),
        (dict(bytes_per_module={}, offload=None, training_calls=0), ["nothing was offloaded on ranks 0, 1: no training iteration completed with chunk-offload attached"]),
        (
            dict(bytes_per_module=_NOTHING, offload=False, training_calls=1),
            ["nothing was offloaded on ranks 0, 1: its only training iterations ran as the report's baseline, without copies "
             "(--chunk-offload-report runs the first one so); train 2 iterations or more"],
        ),
    ],
)  # fmt: skip
def test_nothing_offloaded_warns_with_the_reason(fields: dict, warnings: list[str]) -> None:
    closing = close_run([_summary(0, **fields, report=None), _summary(1, **fields, report=None)], report_path=None)
    assert closing.warnings == warnings and closing.error is None


def test_without_modules_the_launcher_warns_that_nothing_was_offloaded(capsys) -> None:
    assert _close(close_run(None, report_path=None), PROG) == 0
    assert capsys.readouterr() == ("", f"{PROG}: warning: nothing was offloaded: no --chunk-offload-modules given\n")


def test_a_report_that_cannot_be_written_at_the_end_still_prints_the_results_and_exits_1(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # the folder the report would go to is a file now
    summaries = [_summary(0), _summary(1)]
    closing = close_run(summaries, report_path=str(blocker / "r"))
    assert _close(closing, PROG) == 1
    out, err = capsys.readouterr()
    assert out.startswith("chunk-offload summary: ") and "report: not written (see the error below)" in out
    assert out.rstrip("\n").endswith(format_table([sample_report(0), sample_report(1)]))  # the results the files would hold
    assert err.startswith(f"{PROG}: error: --chunk-offload-report {blocker / 'r'}: could not write the report: ")
    assert err.count("\n") == 1


def test_a_rank_without_a_report_fails_the_run_after_the_summary(capsys) -> None:
    closing = close_run([_summary(0), _summary(1, report=None, report_error="the manager has no plan yet")], report_path="out/r")
    assert _close(closing, PROG) == 1
    out, err = capsys.readouterr()
    assert re.search(r"^\|\s+1 \|\s+1/2 \|", out, flags=re.MULTILINE), out  # the summary's row of rank 1
    assert err == f"{PROG}: error: --chunk-offload-report out/r: no report: rank 1: the manager has no plan yet\n"


def test_without_matplotlib_the_run_succeeds_without_the_png(tmp_path: Path, monkeypatch, caplog, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    closing = close_run([_summary(0), _summary(1)], report_path=str(tmp_path / "r"))
    assert _close(closing, PROG) == 0
    assert closing.files.png is None and not (tmp_path / "r.png").exists() and closing.files.json.is_file()
    assert capsys.readouterr().out.rstrip("\n").endswith(f"report: {tmp_path / 'r.json'}, {tmp_path / 'r.md'} (no PNG: see the warning above)\n{NOTATION}")
    assert [r.getMessage() for r in caplog.records] == [
        f"chunk_offload: matplotlib is not installed: skipped the plot {tmp_path / 'r.png'} (pip install 'chunk-offload[plot]')"
    ]


# ---------------------------------------------------------------- from real managers

_NO_MEGATRON = importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None
if not _NO_MEGATRON:
    from tests.integrations.megatron.conftest import managed, pipeline_of_one  # noqa: F401 (fixtures)


@pytest.mark.skipif(_NO_MEGATRON, reason="megatron-core is not installed")
@pytest.mark.parametrize("min_offload_bytes, typed, reason", [
    (1, "", "another reference holds what the offloaded modules saved"),
    (1 << 20, "", "no saved tensor of qkv_linear reached --chunk-offload-min-offload-bytes 1048576 (default 1 MiB)"),
    (1 << 20, "--chunk-offload-min-offload-bytes 1MiB", "no saved tensor of qkv_linear reached --chunk-offload-min-offload-bytes 1MiB (default"),
])  # fmt: skip
def test_stage_summary_reads_the_managers_record_and_report(managed, min_offload_bytes: int, typed: str, reason: str) -> None:
    """Three auto iterations (the first a baseline) of a chunk whose qkv inputs another reference
    holds; the threshold is quoted as typed when the launcher passes it so."""
    from tests.integrations.megatron._auto_iterations import train_step

    chunk, manager = managed(iterations="auto", num_microbatches=2, baseline_iterations=1, trace=True, min_offload_bytes=min_offload_bytes)
    for first in (0, 2, 4):
        train_step(chunk, 2, first=first)
    summary = stage_summary(manager, requested=["qkv_linear", "core_attn"], report=True, min_offload_flag=typed)
    assert manager.training_calls == summary.training_calls == 3  # the last iteration was closed
    assert (summary.rank, summary.pp_rank, summary.pp_size, summary.attached, summary.offload) == (0, 0, 1, True, True)
    assert summary.registered == {"qkv_linear": 2} and summary.groups == {"qkv_linear": 4}
    assert summary.bytes_per_module == {"qkv_linear": 0} and summary.min_offload_bytes == min_offload_bytes
    assert summary.report is not None and summary.report_error is None
    assert summary.measure == summary.report.measure == "cpu_saved_bytes_accounting"
    assert summary.peak_bytes == summary.report.peak_with
    assert summary.iteration_ms == manager.records[-1].wall_time_s * 1e3 > 0 and summary.timed_reload_ahead is False
    assert reason in why_nothing(summary)


@pytest.mark.skipif(_NO_MEGATRON, reason="megatron-core is not installed")
def test_stage_summary_without_a_baseline_has_the_reports_error(managed) -> None:
    from tests.integrations.megatron._auto_iterations import train_step

    chunk, manager = managed(iterations="auto", num_microbatches=2)
    train_step(chunk, 2)
    summary = stage_summary(manager, requested=["qkv_linear"], report=True)
    assert summary.report is None and "all 1 recorded iterations ran with offload" in summary.report_error
    assert stage_summary(None, requested=["qkv_linear"], report=True).report_error == "no model was attached (Megatron-LM built none)"
