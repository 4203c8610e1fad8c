"""``--chunk-offload-plan auto`` through the launcher on Megatron-LM's own ``pretrain`` (megatron-core >= 0.19).

The plan for a device budget is what `co_plan` chooses from the job's own dimensions, the launcher
prints it, sets Megatron's selective recompute before the model is built and attaches each stage's
offload modules; the run is bit-identical to the same recompute set by hand without offload.
Skipped where megatron.training is missing (see test_launcher_v019.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from chunk_offload.megatron_lm.plan import describe, planner_inputs
from chunk_offload.planner import StagePlanner
from chunk_offload.planner.coplan import co_plan

from .test_launcher_v019 import CASES, COMMON, _train  # skips this module too without megatron.training


def _expected_plan(budget_fraction: float):
    """The plan `co_plan` makes for CASES["pp2_vpp2"]'s model (COMMON's sizes, fp32 on CPU), and its budget."""
    args = argparse.Namespace(
        num_layers=4, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4, group_query_attention=False, num_query_groups=None,
        seq_length=16, micro_batch_size=1, global_batch_size=4, data_parallel_size=1, num_experts=None, expert_model_parallel_size=1,
        bf16=False, fp16=False, normalization="LayerNorm", swiglu=False, position_embedding_type="learned_absolute",
        tensor_model_parallel_size=1, sequence_parallel=False, transformer_impl="local", pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
    )  # fmt: skip
    planner = StagePlanner(*planner_inputs(args), min_offload_bytes=0)
    budget = int(budget_fraction * max(s.peak_without_offload_bytes for s in planner.estimate([])))
    return co_plan(planner, budget_bytes=budget), budget


def test_plan_auto_is_applied_and_bit_identical_to_the_same_recompute_by_hand(tmp_path: Path) -> None:
    nproc, case_args, _ = CASES["pp2_vpp2"]
    plan, budget = _expected_plan(0.75)
    assert plan.fits and plan.recompute_modules and any(s.offload_modules for s in plan.stages)  # the case exercises both
    report = tmp_path / "report"
    ours = ["--chunk-offload-plan", "auto", "--chunk-offload-device-budget", str(budget), "--chunk-offload-min-offload-bytes", "0"]
    outputs: list[str] = []
    planned = _train(nproc, case_args, [*ours, "--chunk-offload-report", str(report)], tmp_path, outputs=outputs)
    by_hand = _train(nproc, case_args, plan.megatron_args(), tmp_path)  # the same recompute, no offload
    assert planned == by_hand and any(kind == "loss" for kind, _, _ in planned)
    assert outputs[0].count(describe(plan)) == 1  # printed once, by rank 0
    reports = json.loads(report.with_suffix(".json").read_text())["reports"]
    for r in reports:  # each rank offloaded its stage's modules only
        copied = {module for name, nbytes in r["bytes_per_module"].items() if nbytes for module in name.split("+")}  # a group joins its modules' names
        assert copied <= set(plan.stages[r["pp_rank"]].offload_modules), r
    assert any(r["bytes_per_module"] and sum(r["bytes_per_module"].values()) for r in reports)
