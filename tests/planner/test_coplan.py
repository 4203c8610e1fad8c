"""`co_plan`: keep, offload or recompute per stage and module under a device budget (NOTE [Co-planning]).

Every check compares the plan with the planner's own estimates, made independently here: the
peak the plan predicts is the estimate of the chosen sets, nothing cheaper fits, the rules of
`module_names.combination_problem` hold, and the direction-specific link rates change the choice.
"""

from __future__ import annotations

import dataclasses
import json
from itertools import combinations
from pathlib import Path

import pytest

from chunk_offload import ChunkOffloadError
from chunk_offload.module_names import combination_problem
from chunk_offload.planner import GPTDims, Hardware, PipelineConfig, StagePlanner
from chunk_offload.planner.cli import main
from chunk_offload.planner.coplan import co_plan

_DIMS = GPTDims(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=2048, micro_batch_size=1, attention="local")
_PIPE = PipelineConfig(pipeline_parallel=2, num_microbatches=4)


def _planner(dims: GPTDims = _DIMS, **hardware: float) -> StagePlanner:
    # Module groups: the finest grain the co-plan's brute-force checks compare against.
    return StagePlanner(dims, _PIPE, hardware=Hardware(**hardware), group_by="module")


def _peaks(planner: StagePlanner, recompute: tuple[str, ...], modules: list[str]) -> list[int]:
    under = StagePlanner(dataclasses.replace(planner.dims, recompute_modules=recompute), planner.pipeline, hardware=planner.hardware,
                         group_by=planner.group_by, layer_group_bytes=planner.layer_group_bytes)  # fmt: skip
    return [s.peak_with_offload_bytes for s in under.estimate(modules)]


def test_a_budget_that_fits_keeps_everything() -> None:
    planner = _planner()
    peaks = [s.peak_without_offload_bytes for s in planner.estimate([])]
    plan = co_plan(planner, budget_bytes=max(peaks))
    assert plan.fits and plan.recompute_modules == [] and plan.megatron_args() == []
    assert [(s.offload_modules, s.predicted_peak_bytes, s.predicted_extra_time_ms) for s in plan.stages] == [([], p, 0.0) for p in peaks]
    assert all(r.startswith("kept: the stage fits the budget without moving anything") for s in plan.stages for m, r in s.reasons.items() if m != "stage")


@pytest.mark.parametrize("fraction", [0.6, 0.3, 0.15])
def test_the_plan_is_what_the_estimates_say_and_nothing_cheaper_fits(fraction: float) -> None:
    planner = _planner()
    budget = int(max(s.peak_without_offload_bytes for s in planner.estimate([])) * fraction)
    plan = co_plan(planner, budget_bytes=budget)
    recompute = tuple(plan.recompute_modules)
    for stage in plan.stages:
        assert stage.recompute_modules == plan.recompute_modules
        assert combination_problem(stage.offload_modules, recompute) is None
        assert _peaks(planner, recompute, stage.offload_modules)[stage.pp_rank] == stage.predicted_peak_bytes
        assert stage.fits == (stage.predicted_peak_bytes <= budget)


@pytest.mark.parametrize("fraction", [0.8, 0.5, 0.3])
def test_with_a_free_link_each_stage_copies_the_fewest_bytes_that_fit(fraction: float) -> None:
    """Copies cost nothing at 1e6 GB/s: among the sets that fit (brute force over the estimates), the
    plan copies the fewest bytes per iteration."""
    planner = _planner(host_bandwidth_gbs=1e6)
    budget = int(max(s.peak_without_offload_bytes for s in planner.estimate([])) * fraction)
    plan = co_plan(planner, budget_bytes=budget, recompute_candidates=[])
    names = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1"]
    sets = [list(c) for k in range(len(names) + 1) for c in combinations(names, k) if combination_problem(c) is None]
    estimates = [planner.estimate(m) for m in sets]
    assert plan.fits
    for stage in plan.stages:
        fitting = [e[stage.pp_rank].bytes_offloaded for e in estimates if e[stage.pp_rank].peak_with_offload_bytes <= budget]
        chosen = planner.estimate(stage.offload_modules)[stage.pp_rank]
        assert chosen.bytes_offloaded == min(fitting) and stage.predicted_extra_time_ms == 0.0, stage


def test_long_sequences_with_the_local_attention_recompute_it() -> None:
    """The local attention's s x s softmax dominates and costs little forward to redo: recompute it."""
    plan = co_plan(_planner(), budget_bytes=int(0.3 * max(s.peak_without_offload_bytes for s in _planner().estimate([]))))
    assert plan.fits and plan.recompute_modules == ["core_attn"]
    assert plan.megatron_args() == ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
    assert all("core_attn" not in s.offload_modules for s in plan.stages)


def test_a_slow_reload_link_moves_the_choice_from_offload_to_recompute() -> None:
    """A layer whose compute hides a 1000 GB/s copy of its softmax; with reloads at 1 GB/s it cannot."""
    dims = GPTDims(num_layers=4, hidden_size=4096, num_attention_heads=32, seq_length=4096, micro_batch_size=1, attention="local")
    budget = int(0.5 * max(s.peak_without_offload_bytes for s in _planner(dims).estimate([])))
    fast = co_plan(_planner(dims, host_bandwidth_gbs=1000.0), budget_bytes=budget)
    slow = co_plan(_planner(dims, host_bandwidth_gbs=1000.0, h2d_gbps=1.0), budget_bytes=budget)
    assert fast.fits and slow.fits
    assert fast.recompute_modules == [] and "core_attn" in fast.stages[0].offload_modules
    assert all(s.predicted_extra_time_ms == 0.0 for s in fast.stages)
    assert slow.recompute_modules == ["core_attn"] and all(s.offload_modules == [] for s in slow.stages)
    assert all(s.predicted_extra_time_ms > 0.0 for s in slow.stages)


def test_an_impossible_budget_says_so_per_stage() -> None:
    plan = co_plan(_planner(), budget_bytes=1)
    assert not plan.fits and all(not s.fits for s in plan.stages)
    assert all(s.reasons["stage"].startswith(f"over the budget by {s.predicted_peak_bytes - 1} bytes") for s in plan.stages)


def test_bad_arguments() -> None:
    with pytest.raises(ChunkOffloadError, match=r"budget_bytes must be an int >= 0, got -1"):
        co_plan(_planner(), budget_bytes=-1)
    with pytest.raises(ChunkOffloadError, match=r"recompute candidates \['moe'\] not modelled for this model; choose from \['core_attn'\]"):
        co_plan(_planner(), budget_bytes=1, recompute_candidates=["moe"])
    with pytest.raises(ChunkOffloadError, match=r"co_plan chooses the recompute modules"):
        co_plan(_planner(dataclasses.replace(_DIMS, recompute_modules=("core_attn",))), budget_bytes=1)


_ARGS = ["plan", "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "2048",
         "--micro-batch-size", "1", "--num-microbatches", "4", "--pp", "2", "--attention", "local"]  # fmt: skip


def test_the_command_line_prints_and_writes_the_plan(tmp_path: Path, capsys) -> None:
    path = tmp_path / "plan.json"
    budget_gb = 0.3 * max(s.peak_without_offload_bytes for s in _planner().estimate([])) / 1e9
    assert main([*_ARGS, "--budget-gb", str(budget_gb), "--co-plan", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    data = json.loads(path.read_text())["co_plan"]
    expected = co_plan(_planner(dims=dataclasses.replace(_DIMS, device="cuda", dtype="bf16")), budget_bytes=round(budget_gb * 1e9))
    assert data == expected.to_dict()
    assert set(data["stages"][0]) == {"pp_rank", "offload_modules", "recompute_modules", "fits", "predicted_peak_bytes", "predicted_extra_time_ms", "reasons"}
    assert "Megatron flags: --recompute-granularity selective --recompute-modules core_attn" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--co-plan"], "argument --co-plan: needs --budget-gb"),
        (["--co-plan", "--budget-gb", "1", "--recompute-modules", "core_attn"], "argument --co-plan: cannot be combined with --recompute-modules"),
        (["--h2d-gbps", "0"], "--h2d-gbps must be a finite number > 0, got 0.0"),
        (["--recompute-modules", "mlp"], "argument --recompute-modules: invalid choice: 'mlp'"),
        (["--modules", "attn_proj"], "--modules attn_proj: "),
    ],
)
def test_command_line_usage_errors(extra: list[str], message: str, capsys) -> None:
    try:
        status = main([*_ARGS, *extra])
    except SystemExit as e:
        status = e.code
    assert status == 2
    assert message in capsys.readouterr().err


def test_attn_proj_is_offloaded_where_core_attn_is_recomputed(capsys) -> None:
    """Megatron's rule, as the launcher and the replay apply it: attn_proj's input is core
    attention's output, which a recomputed core_attn does not keep."""
    assert main([*_ARGS, "--modules", "attn_proj", "--recompute-modules", "core_attn"]) == 0
    assert "attn_proj" in capsys.readouterr().out
