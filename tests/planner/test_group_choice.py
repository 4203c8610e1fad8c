"""``chunk-offload plan --budget-gb``: the per-group choice per stage, as `choose_offload` makes it
from the planner's predicted bytes (equal to the measured ones on CPU: tests/planner/test_estimate.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from chunk_offload.planner import GB, StagePlanner, choose_groups
from chunk_offload.planner.cli import main
from chunk_offload.schedule import PlanPolicy, choose_offload, simulate

from .test_cli import _ARGS, _DIMS, _HARDWARE, _PIPELINE

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron_plan reads megatron-core's schedule tables"
)


_MODULE_GROUPS = ["--group-by", "module"]
"""A group per module call, so that the choices below count each module's groups."""


def _planner() -> StagePlanner:
    return StagePlanner(_DIMS, _PIPELINE, hardware=_HARDWARE, min_offload_bytes=1, group_by="module")


def _budgets(stages) -> list[int]:
    """Between the last stage's estimated peak without offload and the first's."""
    first, last = stages[0].peak_without_offload_bytes, stages[-1].peak_without_offload_bytes
    assert last < first
    return [last, (last + first) // 2, first - 1]


def test_choices_meet_the_budget_as_simulated():
    planner = _planner()
    stages = planner.estimate(["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1"])
    for budget in _budgets(stages):
        for stage, choice in zip(stages, choose_groups(planner, stages, budget_bytes=budget), strict=True):
            plan = planner.plans[stage.pp_rank]
            group_budget = budget - (stage.peak_without_offload_bytes - stage.peak_saved_bytes)
            # The bytes held elsewhere stay on device (NOTE [Storages held elsewhere]).
            kept = stage.group_kept_bytes
            assert choice.choice == choose_offload(plan, stage.group_bytes, group_budget, kept_bytes=kept)
            policy = PlanPolicy(plan, offload_groups=choice.choice)
            assert simulate(plan, stage.group_bytes, policy=policy, kept_bytes=kept).peak_resident_bytes == choice.choice.predicted_peak_bytes
            if stage.peak_without_offload_bytes <= budget:
                assert choice.choice.offloaded == {} and choice.peak_with_offload_bytes == stage.peak_without_offload_bytes
            elif choice.fits:
                assert choice.peak_with_offload_bytes <= budget < stage.peak_without_offload_bytes
            assert sum(choice.by_module.values()) == choice.choice.groups_offloaded
            layer_order = list(dict.fromkeys(stage.group_names[0]))
            assert list(choice.by_module) == [m for m in layer_order if m in choice.by_module]


def test_cli_shows_the_choice(capsys, tmp_path: Path):
    planner = _planner()
    stages = planner.estimate(["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1"])
    budget = _budgets(stages)[1]
    path = tmp_path / "plan.json"
    status = main([*_ARGS, *_MODULE_GROUPS, "--budget-gb", repr(budget / GB), "--json", str(path)])
    out = capsys.readouterr().out
    assert status == 0
    expected = choose_groups(planner, stages, budget_bytes=round(budget / GB * GB))
    data = json.loads(path.read_text())
    assert data["group_choices"] == [json.loads(json.dumps(c.to_dict())) for c in expected]
    assert data["stages"][0]["group_names"] == {str(vp): n for vp, n in stages[0].group_names.items()}
    assert "per group, as a device budget chooses at run time" in out
    for c in expected:
        assert f"  {c.describe()}" in out
    first, last = expected[0], expected[-1]
    assert first.fits and first.choice.groups_offloaded > 0 and f"offload {first.choice.groups_offloaded} of {first.groups_total} groups" in out
    assert last.choice.offloaded == {} and "stage 1: offload no group" in out
    offloaded = data["group_choices"][0]["offloaded"]
    assert sum(map(len, offloaded.values())) == first.choice.groups_offloaded


def test_infeasible_budget_names_the_lowest_peak(capsys):
    status = main([*_ARGS, *_MODULE_GROUPS, "--budget-gb", "0"])
    out = capsys.readouterr().out
    assert status == 0
    planner = _planner()
    stages = planner.estimate(["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1"])
    for c in choose_groups(planner, stages, budget_bytes=0):
        assert not c.fits
        assert f"stage {c.pp_rank}: offload {c.choice.groups_offloaded} of {c.groups_total} groups" in out
    assert "does not fit: the lowest peak is " in out
