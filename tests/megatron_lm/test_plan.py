"""``--chunk-offload-plan``'s pieces without Megatron-LM: the planner's inputs from Megatron's arguments,
a plan file, and the recompute it sets (chunk_offload/megatron_lm/plan.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from chunk_offload import ChunkOffloadError
from chunk_offload.megatron_lm.plan import apply_plan, describe, load_plan, planner_inputs, resolve_plan, stage_modules
from chunk_offload.planner import StagePlanner
from chunk_offload.planner.coplan import co_plan


def _megatron_args(**overrides) -> argparse.Namespace:
    """What Megatron-LM's validated arguments hold for a small GPT (the names its parser uses)."""
    values = dict(
        num_layers=4, hidden_size=512, ffn_hidden_size=2048, num_attention_heads=8, group_query_attention=False, num_query_groups=1,
        seq_length=2048, micro_batch_size=1, global_batch_size=8, data_parallel_size=1, num_experts=None, moe_router_topk=2,
        moe_layer_freq=1, expert_model_parallel_size=1, bf16=True, fp16=False, normalization="LayerNorm", swiglu=False,
        bias_swiglu_fusion=True, position_embedding_type="learned_absolute", tensor_model_parallel_size=1, sequence_parallel=False,
        transformer_impl="local", pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=None,
        microbatch_group_size_per_vp_stage=None, recompute_granularity=None, recompute_modules=None,
        chunk_offload_plan="auto", chunk_offload_device_budget=None, chunk_offload_min_offload_bytes=1 << 20, chunk_offload_schedule="plan", chunk_offload_group_by="module", chunk_offload_layer_group_bytes=None,
    )  # fmt: skip
    values.update(overrides)
    return argparse.Namespace(**values)


def test_planner_inputs_follow_megatrons_arguments() -> None:
    dims, pipeline = planner_inputs(_megatron_args(group_query_attention=True, num_query_groups=2, global_batch_size=16, data_parallel_size=2))
    assert (dims.num_layers, dims.hidden_size, dims.query_groups, dims.dtype, dims.attention) == (4, 512, 2, "bf16", "local")
    assert (pipeline.pipeline_parallel, pipeline.num_microbatches, pipeline.virtual_pipeline) == (2, 8, None)
    moe, _ = planner_inputs(_megatron_args(num_experts=4, moe_layer_freq=[1, 0, 1, 0], expert_model_parallel_size=2))
    assert moe.moe_layer_freq == (1, 0, 1, 0) and moe.expert_parallel == 2


def test_auto_is_the_co_plan_of_the_jobs_dimensions(tmp_path: Path) -> None:
    budget = 400_000_000
    args = _megatron_args(chunk_offload_device_budget=budget)
    dims, pipeline = planner_inputs(args)
    expected = co_plan(StagePlanner(dims, pipeline), budget_bytes=budget)
    plan = resolve_plan(args)
    assert plan.to_dict() == expected.to_dict() and plan.recompute_modules == ["core_attn"]
    apply_plan(args, plan)
    assert (args.recompute_granularity, args.recompute_modules) == ("selective", ["core_attn"])
    assert [stage_modules(plan, r) for r in range(2)] == [s.offload_modules for s in expected.stages]
    assert describe(plan).startswith("chunk-offload plan (fits 400000000 bytes per stage): --recompute-granularity selective --recompute-modules core_attn; offload stage 0: ")
    # The same plan through a file, as chunk-offload plan --co-plan --json writes it.
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"co_plan": plan.to_dict()}))
    assert resolve_plan(_megatron_args(chunk_offload_plan=str(path))).to_dict() == plan.to_dict()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"recompute_granularity": "full"}, r"recomputes \['core_attn'\] but the command line sets --recompute-granularity full"),
        ({"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, "the command line sets --recompute-modules mlp; drop"),
    ],
)
def test_a_recompute_the_command_line_sets_otherwise_is_refused(overrides: dict, message: str) -> None:
    args = _megatron_args(chunk_offload_device_budget=400_000_000, **overrides)
    with pytest.raises(ChunkOffloadError, match=message):
        apply_plan(args, resolve_plan(args))


def test_bad_plan_files(tmp_path: Path) -> None:
    with pytest.raises(ChunkOffloadError, match=r"--chunk-offload-plan .*missing.json: cannot read a plan"):
        load_plan(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text(json.dumps({"stages": [{"pp_rank": 0}]}))
    with pytest.raises(ChunkOffloadError, match=r"not a plan .*chunk-offload plan \.\.\. --budget-gb GB --co-plan --json FILE"):
        load_plan(tmp_path / "other.json")
    planned = co_plan(StagePlanner(*planner_inputs(_megatron_args(pipeline_model_parallel_size=4))), budget_bytes=1 << 40)
    (tmp_path / "four.json").write_text(json.dumps(planned.to_dict()))
    with pytest.raises(ChunkOffloadError, match=r"the plan has 4 stages, the job --pipeline-model-parallel-size 2"):
        resolve_plan(_megatron_args(chunk_offload_plan=str(tmp_path / "four.json")))


def test_a_script_of_your_own_gets_a_clear_error() -> None:
    """The plan is applied by the launcher before the model is built; attach_from_args cannot do that."""
    from torch import nn

    from chunk_offload.integrations.megatron import add_arguments, attach_from_args

    args = add_arguments(argparse.ArgumentParser()).parse_args(["--chunk-offload-plan", "auto", "--chunk-offload-device-budget", "1GiB"])
    with pytest.raises(ChunkOffloadError, match=r"--chunk-offload-plan auto is the launcher's: python -m chunk_offload.megatron_lm SCRIPT"):
        attach_from_args(nn.Linear(2, 2), args)
