"""`recommend`: the cheapest module set per stage that fits a budget without stalls."""

from __future__ import annotations

import importlib.util
from itertools import combinations

import pytest

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.module_names import combination_problem
from chunk_offload.planner import GPTDims, Hardware, PipelineConfig, StagePlanner, recommend

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron_plan reads megatron-core's schedule tables"
)

_DIMS = GPTDims(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2, dtype="bf16")
_PIPELINE = PipelineConfig(pipeline_parallel=2, virtual_pipeline=2, num_microbatches=4)
_NAMES = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1"]
_FAST = Hardware(host_bandwidth_gbs=1e6, device_tflops=1e-6)  # every copy hides


def _planner(hardware: Hardware = _FAST) -> StagePlanner:
    return StagePlanner(_DIMS, _PIPELINE, hardware=hardware, min_offload_bytes=1)


def _all_sets(planner: StagePlanner):
    """Every set megatron-core's rules allow (`combination_problem`): the sets `recommend` may choose."""
    sets = [list(c) for k in range(len(_NAMES) + 1) for c in combinations(_NAMES, k) if combination_problem(c) is None]
    return [planner.estimate(s) for s in sets]


def test_large_budget_needs_no_offload():
    planner = _planner()
    budget = max(s.peak_without_offload_bytes for s in planner.estimate([]))
    for r in recommend(planner, budget_bytes=budget):
        assert r.fits and r.modules == [] and r.choice.bytes_offloaded == 0
        assert "fits without offload" in r.describe()


def test_middle_budget_takes_the_cheapest_set_that_fits():
    planner = _planner()
    nothing, everything = planner.estimate([])[0], planner.estimate(_NAMES)[0]
    assert everything.peak_with_offload_bytes < nothing.peak_with_offload_bytes
    budget = (nothing.peak_with_offload_bytes + everything.peak_with_offload_bytes) // 2
    choice = recommend(planner, budget_bytes=budget)[0]
    assert choice.fits and choice.modules
    assert choice.choice.peak_with_offload_bytes <= budget
    # No set that copies fewer bytes fits (checked over every allowed set of the 2^6).
    for estimates in _all_sets(planner):
        stage = estimates[0]
        if stage.bytes_offloaded < choice.choice.bytes_offloaded:
            assert stage.peak_with_offload_bytes > budget, stage.modules


def test_no_set_fits_names_the_best_achievable():
    planner = _planner()
    results = recommend(planner, budget_bytes=0)
    for r in results:
        assert not r.fits and r.modules is None
        lowest = min(s[r.pp_rank].peak_with_offload_bytes for s in _all_sets(planner))
        assert r.lowest_peak.peak_with_offload_bytes == lowest
        assert r.best_hiding is not None and r.best_hiding.peak_with_offload_bytes == lowest  # all hide here
        assert r.describe().startswith(f"stage {r.pp_rank}: no module set fits 0.000 GB without stalls; best without stalls: ")


def test_copies_that_do_not_hide_disqualify():
    """With a slow host link only the empty set hides: the budget below its peak cannot be met."""
    planner = _planner(Hardware(host_bandwidth_gbs=1e-9, device_tflops=1e9))
    nothing = planner.estimate([])[0]
    r = recommend(planner, budget_bytes=nothing.peak_with_offload_bytes - 1)[0]
    assert not r.fits
    assert r.best_hiding.modules == [] and r.best_hiding.peak_with_offload_bytes == nothing.peak_with_offload_bytes
    assert not r.lowest_peak.hides and "(copies do not hide)" in r.describe()


def test_other_activation_bytes_count_against_the_budget():
    base = _planner().estimate([])[0].peak_with_offload_bytes
    extra = StagePlanner(_DIMS, _PIPELINE, hardware=_FAST, min_offload_bytes=1, other_activation_bytes=1000)
    assert extra.estimate([])[0].peak_with_offload_bytes == base + 1000
    r = recommend(extra, budget_bytes=base)[0]
    assert r.fits and r.modules  # the empty set no longer fits: something must be offloaded


def test_invalid_arguments():
    planner = _planner()
    with pytest.raises(ChunkOffloadError, match="budget_bytes must be an int >= 0, got -1"):
        recommend(planner, budget_bytes=-1)
    with pytest.raises(ChunkOffloadError, match="unknown offload module 'mlp'"):
        recommend(planner, budget_bytes=1, candidates=["mlp"])
