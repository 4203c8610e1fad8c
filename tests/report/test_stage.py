"""`StageReport`: derived drop and R, and its plain-data form with the checks on reading it back."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.report import MEASURES, StageReport

from ._reports import sample_report


def test_drop_and_ratio_follow_the_peaks():
    report = sample_report(0)
    assert report.measured_drop == report.peak_without - report.peak_with
    assert report.ratio == report.measured_drop / report.theoretical_drop
    half = replace(report, peak_with=report.peak_without - report.theoretical_drop // 2)
    assert half.ratio == (report.theoretical_drop // 2) / report.theoretical_drop


@pytest.mark.parametrize("theoretical", [0, -256])
def test_ratio_is_none_when_the_plan_predicts_no_drop(theoretical):
    report = replace(sample_report(0), theoretical_drop=theoretical)
    assert report.ratio is None
    assert report.to_dict()["R"] is None


def test_dict_round_trip_and_derived_keys():
    report = sample_report(1)
    data = report.to_dict()
    assert data["measured_drop"] == report.measured_drop and data["R"] == report.ratio
    assert StageReport.from_dict(data) == report
    data["bytes_per_module"]["core_attn"] += 1  # the dict is a copy, not the report's own
    assert report.bytes_per_module["core_attn"] != data["bytes_per_module"]["core_attn"]


def test_pickles_for_gathering():
    report = sample_report(1)
    assert pickle.loads(pickle.dumps(report)) == report


def test_from_dict_rejects_inconsistent_derived_values():
    data = sample_report(0).to_dict()
    data["measured_drop"] += 1
    with pytest.raises(ChunkOffloadError, match=r"rank 0: measured_drop=\d+ does not match its peaks"):
        StageReport.from_dict(data)
    data = sample_report(0).to_dict()
    data["R"] = 0.5
    with pytest.raises(ChunkOffloadError, match=r"R=0.5 does not match"):
        StageReport.from_dict(data)


def test_from_dict_names_unknown_and_missing_fields_and_bad_measure():
    data = sample_report(0).to_dict()
    data["colour"] = "red"
    del data["peak_with"]
    with pytest.raises(ChunkOffloadError, match=r"unknown fields \['colour'\] and lacks fields \['peak_with'\]"):
        StageReport.from_dict(data)
    data = sample_report(0).to_dict()
    data["measure"] = "rss"
    with pytest.raises(ChunkOffloadError, match=r"measure 'rss' is not one of \['cpu_saved_bytes_accounting', 'cuda_max_memory_allocated'\]"):
        StageReport.from_dict(data)
    assert sorted(MEASURES) == ["cpu_saved_bytes_accounting", "cuda_max_memory_allocated"]


# --------------------------------------------------------------------------------------------
# stage_report from real records of the core engine (no Megatron): stage 0 of a 4-stage 1F1B.
# --------------------------------------------------------------------------------------------

ORDER = ("F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3")


def _plan():
    from chunk_offload.schedule.plan import Plan

    return Plan.from_order([f"0{a}" for a in ORDER], pp_rank=0, pp_size=4, vp_size=1, source="test 1F1B")


def _records(batch_sizes=(2, 2)):
    """A baseline and an offload record; ``batch_sizes`` per iteration change the bytes per group."""
    import chunk_offload
    from tests._driver import Hooks, drive
    from tests.core._models import HIDDEN, SEQ, make_stack, register

    model = make_stack(layers=2)
    manager = chunk_offload.OffloadManager(chunk_offload.OffloadConfig(min_offload_bytes=1, trace=True), streams=chunk_offload.CpuStreams())
    register(manager, model)
    xs = []
    for it, batch in enumerate(batch_sizes):
        g = torch.Generator().manual_seed(it)
        xs.append([torch.randn(batch, SEQ, HIDDEN, generator=g) for _ in range(4)])
    records = []
    try:
        drive(
            model,
            inputs=lambda it, m: xs[it][m],
            manager=manager,
            order=ORDER,
            iterations=2,
            offload=lambda it: it == 1,  # a baseline, then the offload run
            lr=None,
            hooks=Hooks(after_iteration=lambda manager, it: records.append(manager.last_iteration)),
        )
    finally:
        manager.close()
    return manager, records


def test_report_from_core_records_has_r_exactly_one():
    from chunk_offload.report import stage_report
    from chunk_offload.schedule import simulate

    manager, (baseline, offloaded) = _records()
    plan = _plan()
    report = stage_report(baseline=baseline, offloaded=offloaded, plan=plan, rank=3, policy=manager.schedule_policy, baseline_iteration=0, offload_iteration=1)
    assert (report.rank, report.pp_rank, report.pp_size, report.vp_size) == (3, 0, 4, 1)
    assert report.measure == "cpu_saved_bytes_accounting"
    assert report.peak_without == baseline.peak_resident_bytes and report.peak_with == offloaded.peak_resident_bytes
    assert report.theoretical_drop > 0 and report.measured_drop == report.theoretical_drop and report.ratio == 1.0
    # Equal bytes per group in both iterations: the theoretical drop is the simulation's drop.
    assert baseline.group_bytes == offloaded.group_bytes
    # With the bytes the offload iteration kept on device (NOTE [Storages held elsewhere]).
    simulation = simulate(plan, lambda m, v: baseline.group_bytes[(m, v)], policy=manager.schedule_policy, kept_bytes=offloaded.kept_bytes_of)
    assert report.theoretical_drop == simulation.drop
    assert report.trace_without == baseline.resident_trace and report.trace_with == offloaded.resident_trace
    assert report.bytes_per_module == {n: g.bytes_offloaded for n, g in offloaded.groups.items()}


def test_bytes_that_change_between_iterations_stay_out_of_r():
    """NOTE [Theoretical drop]: each peak is predicted from its own iteration's bytes (MoE routing)."""
    from chunk_offload.report import stage_report

    manager, (baseline, offloaded) = _records(batch_sizes=(2, 3))
    assert baseline.group_bytes != offloaded.group_bytes
    report = stage_report(baseline=baseline, offloaded=offloaded, plan=_plan(), rank=0, policy=manager.schedule_policy)
    assert report.predicted_peak_without == report.peak_without and report.predicted_peak_with == report.peak_with
    assert report.ratio == 1.0


def test_stage_report_rejects_swapped_records_other_plans_and_mixed_devices():
    from chunk_offload.report import stage_report
    from chunk_offload.schedule.plan import Plan

    _, (baseline, offloaded) = _records()
    with pytest.raises(ChunkOffloadError, match="the baseline record ran with offload"):
        stage_report(baseline=offloaded, offloaded=offloaded, plan=_plan(), rank=0)
    with pytest.raises(ChunkOffloadError, match="the offload record ran without offload"):
        stage_report(baseline=baseline, offloaded=baseline, plan=_plan(), rank=0)
    longer = Plan.from_order(["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0F4", "0B2", "0B3", "0B4"], source="five")
    with pytest.raises(ChunkOffloadError, match=r"the baseline iteration recorded no groups for chunks \[\(4, 0\)\] of plan 'five'"):
        stage_report(baseline=baseline, offloaded=offloaded, plan=longer, rank=0)
    on_cuda = replace(offloaded, device_peak_bytes=1 << 20)
    with pytest.raises(ChunkOffloadError, match="one record has a CUDA peak"):
        stage_report(baseline=baseline, offloaded=on_cuda, plan=_plan(), rank=0)


def test_cuda_records_use_the_device_peaks_and_traces():
    """Records with ``device_peak_bytes`` (as on CUDA) are measured by it; the prediction is unchanged."""
    from chunk_offload.report import stage_report

    manager, (baseline, offloaded) = _records()
    cpu = stage_report(baseline=baseline, offloaded=offloaded, plan=_plan(), rank=0, policy=manager.schedule_policy)
    overhead = 5 << 20  # parameters, optimizer state, workspace: the same in both iterations
    on_device = [
        replace(r, device_peak_bytes=r.peak_resident_bytes + overhead, device_trace=[b + overhead for b in r.resident_trace])
        for r in (baseline, offloaded)
    ]
    cuda = stage_report(baseline=on_device[0], offloaded=on_device[1], plan=_plan(), rank=0, policy=manager.schedule_policy)
    assert cuda.measure == "cuda_max_memory_allocated"
    assert (cuda.peak_without, cuda.peak_with) == (cpu.peak_without + overhead, cpu.peak_with + overhead)
    assert cuda.trace_with == on_device[1].device_trace
    assert cuda.theoretical_drop == cpu.theoretical_drop and cuda.ratio == 1.0
