"""``chunk-offload plan``: flags that contradict each other get one usage error naming both
(exit status 2, before anything is computed), and a budget that cannot be met says so per
stage, with the bytes over and the reason, in the table and the JSON (issue 23)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from chunk_offload import ChunkOffloadError

from chunk_offload.planner import GB, StagePlanner, choose_groups
from chunk_offload.planner.cli import main

from .test_cli import _ARGS, _DIMS, _HARDWARE, _PIPELINE

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron_plan reads megatron-core's schedule tables"
)

_SMALL = ["plan", "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
          "--num-microbatches", "4", "--pp", "2"]  # fmt: skip
"""The issue's command: every saved tensor is below the default --min-offload-bytes (1 MiB)."""


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--budget-gb", "1", "--policy", "all"], "argument --budget-gb: cannot be combined with --policy all: "),
        (["--policy", "all", "--budget-gb", "1"], "argument --budget-gb: cannot be combined with --policy all: "),
        (["--budg", "1", "--pol", "all"], "argument --budg: cannot be combined with --pol all: "),
        (["--budget-gb", "1", "--schedule", "group-start"], "argument --budget-gb: cannot be combined with --schedule group-start: "),
        (["--schedule", "plan", "--policy", "all"], "argument --policy: cannot be combined with --schedule plan: --policy is the deprecated"),
        (["--rope", "--position-embedding-type", "learned_absolute"], "argument --rope: cannot be combined with --position-embedding-type learned_absolute"),
        (["--no-bias-swiglu-fusion"], "argument --no-bias-swiglu-fusion: needs --swiglu: "),
        (["--moe-router-topk", "4"], "argument --moe-router-topk: needs --num-experts: "),
        (["--moe-layer-freq", "2"], "argument --moe-layer-freq: needs --num-experts: "),
        (["--attention", "local", "--transformer-impl", "transformer_engine"], "argument --attention: cannot be combined with --transformer-impl transformer_engine"),
        (["--attention", "local", "--attention-kernel", "efficient"], "argument --attention-kernel: cannot be combined with --attention local"),
    ],
)
def test_contradictory_flags_get_one_usage_error_naming_both(capsys, monkeypatch, extra, message):
    from chunk_offload.planner import cli

    monkeypatch.setattr(cli, "_plan", lambda args: pytest.fail("computed before checking the flags"))
    with pytest.raises(SystemExit) as info:
        main([*_ARGS, *extra])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.count("error:") == 1


def test_deprecated_policy_flag_warns_and_plans_as_the_schedule_it_names(capsys, tmp_path: Path):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    assert main([*_ARGS, "--policy", "all", "--json", str(old)]) == 0
    assert "--policy all is deprecated and will be removed in the next release; use --schedule group-start" in capsys.readouterr().err
    assert main([*_ARGS, "--schedule", "group-start", "--json", str(new)]) == 0
    assert "deprecated" not in capsys.readouterr().err
    assert json.loads(old.read_text()) == json.loads(new.read_text())
    assert json.loads(new.read_text())["schedule_policy"] == "group-start"


def test_deprecated_policy_keyword_of_the_library_warns():
    from chunk_offload.planner import GPTDims, PipelineConfig, StagePlanner

    dims = GPTDims(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=1)
    pipeline = PipelineConfig(pipeline_parallel=2, num_microbatches=4)
    with pytest.warns(DeprecationWarning, match=r"policy='all' is deprecated .* pass schedule='group-start'"):
        planner = StagePlanner(dims, pipeline, policy="all")
    assert planner.schedule == "group-start"
    assert StagePlanner(dims, pipeline, schedule="group-start").estimate("core_attn") == planner.estimate("core_attn")
    with pytest.raises(ChunkOffloadError, match=r"schedule='all' is not valid; choose one of \('plan', 'group-start'\)"):
        StagePlanner(dims, pipeline, schedule="all")


def test_microbatch_group_size_without_vpp_is_a_usage_error(capsys):
    without_vpp = _ARGS[: _ARGS.index("--vpp")] + _ARGS[_ARGS.index("--vpp") + 2 :]
    with pytest.raises(SystemExit) as info:
        main([*without_vpp, "--microbatch-group-size-per-vp-stage", "2"])
    assert info.value.code == 2
    assert "argument --microbatch-group-size-per-vp-stage: needs --vpp: " in capsys.readouterr().err


def test_rope_twice_the_same_way_is_accepted(capsys, tmp_path: Path):
    path = tmp_path / "plan.json"
    assert main([*_ARGS, "--rope", "--position-embedding-type", "rope", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["model"]["position_embedding_type"] == "rope"


def test_a_budget_nothing_can_meet_says_fits_false_with_the_bytes_over_and_why(capsys, tmp_path: Path):
    path = tmp_path / "plan.json"
    assert main([*_SMALL, "--budget-gb", "0.004", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    for stage, choice in zip(data["stages"], data["group_choices"], strict=True):
        verdict = stage["budget"]
        assert verdict["fits"] is False and choice["fits"] is False
        over = choice["peak_with_offload_bytes"] - 4_000_000
        assert verdict["over_bytes"] == choice["over_bytes"] == over > 0
        assert "nothing can be offloaded" in verdict["reason"] and "1048576 B" in verdict["reason"]
    table = out.split("per stage (GB")[1].splitlines()
    assert table[1].split()[-3:] == ["fits", "over", "MB"]
    rows = [line.split() for line in table[3:5]]
    assert [r[-2] for r in rows] == ["NO", "NO"]
    assert [r[-1] for r in rows] == [f"{s['budget']['over_bytes'] / 1e6:.2f}" for s in data["stages"]]
    assert "<= budget" not in out
    assert "stage 0: does not fit: peak 8.438 MB > budget 4.000 MB, 4.438 MB over: nothing can be offloaded" in out


def test_a_budget_below_what_offload_cannot_move_does_not_fit():
    planner = StagePlanner(_DIMS, _PIPELINE, hardware=_HARDWARE, min_offload_bytes=1)
    stages = planner.estimate(["core_attn"])  # the other modules' activations stay
    budget = 1
    for stage, choice in zip(stages, choose_groups(planner, stages, budget_bytes=budget), strict=True):
        assert choice.other_bytes > budget
        assert not choice.fits and choice.reason.startswith("the activations offload does not move")
        assert choice.over_bytes == choice.other_bytes + choice.choice.lowest_peak_bytes - budget
        assert choice.to_dict()["fits"] is False


def test_a_budget_that_fits_has_no_reason_and_no_bytes_over(tmp_path: Path, capsys):
    path = tmp_path / "plan.json"
    assert main([*_ARGS, "--budget-gb", "1", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert [s["budget"] for s in data["stages"]] == [
        {"budget_bytes": int(GB), "fits": True, "over_bytes": 0, "reason": None} for _ in data["stages"]
    ]
