"""``--chunk-offload-plan auto|FILE``: a co-plan (keep / offload / recompute) applied before the model is built.

``auto`` runs `chunk_offload.planner.co_plan` on the job's own dimensions, read from Megatron-LM's
parsed arguments (`planner_inputs`), under ``--chunk-offload-device-budget BYTES``; a FILE is the
JSON a ``chunk-offload plan ... --co-plan --json FILE`` wrote (its ``co_plan``) or the plan alone.
`apply_plan` sets Megatron's ``--recompute-granularity selective --recompute-modules`` on the
parsed arguments, which the model provider reads when it builds the layers, and each rank attaches
its stage's ``offload_modules`` (`stage_modules`). It runs after Megatron-LM's argument checks and
before any model is built (NOTE [One build per run] in ``entry_points.py``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from ..core import ChunkOffloadError
from ..planner import GPTDims, PipelineConfig, StagePlanner
from ..planner.coplan import CoPlan, StagePlan, co_plan

__all__ = ["apply_plan", "describe", "load_plan", "planner_inputs", "resolve_plan", "stage_modules"]

_FLAG = "--chunk-offload-plan"


def planner_inputs(args: argparse.Namespace) -> tuple[GPTDims, PipelineConfig]:
    """The planner's model and pipeline from Megatron-LM's validated arguments."""
    if args.position_embedding_type not in ("rope", "learned_absolute"):
        raise ChunkOffloadError(f"{_FLAG} auto models --position-embedding-type rope or learned_absolute, got {args.position_embedding_type}")
    impl = getattr(args, "transformer_impl", "local")
    dims = GPTDims(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else None,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        num_experts=args.num_experts,
        moe_router_topk=getattr(args, "moe_router_topk", 2),
        moe_layer_freq=_layer_freq(getattr(args, "moe_layer_freq", 1)),
        expert_parallel=args.expert_model_parallel_size,
        dtype="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        device="cuda" if torch.cuda.is_available() else "cpu",
        normalization=args.normalization,
        swiglu=bool(args.swiglu),
        bias_swiglu_fusion=bool(getattr(args, "bias_swiglu_fusion", True)),
        position_embedding_type=args.position_embedding_type,
        tensor_parallel=args.tensor_model_parallel_size,
        sequence_parallel=bool(args.sequence_parallel),
        attention="local",  # Megatron-LM's local spec: megatron's DotProductAttention
        transformer_impl="transformer_engine" if impl == "transformer_engine" else "local",
    )
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    pipeline = PipelineConfig(
        pipeline_parallel=args.pipeline_model_parallel_size,
        virtual_pipeline=vpp if vpp and vpp > 1 else None,
        num_microbatches=args.global_batch_size // (args.micro_batch_size * args.data_parallel_size),
        microbatch_group_size_per_vp_stage=getattr(args, "microbatch_group_size_per_vp_stage", None),
    )
    return dims, pipeline


def _layer_freq(freq: Any) -> int | tuple[int, ...]:
    return tuple(int(v) for v in freq) if isinstance(freq, (list, tuple)) else int(freq)


def load_plan(path: str | Path) -> CoPlan:
    """A plan from ``path``: the JSON of ``chunk-offload plan --co-plan --json`` or its ``co_plan`` alone."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ChunkOffloadError(f"{_FLAG} {path}: cannot read a plan: {e}") from None
    data = data.get("co_plan", data) if isinstance(data, dict) else data
    try:
        stages = [StagePlan(**stage) for stage in data["stages"]]
        return CoPlan(budget_bytes=int(data["budget_bytes"]), recompute_modules=list(data["recompute_modules"]), stages=stages)
    except (KeyError, TypeError) as e:
        raise ChunkOffloadError(
            f"{_FLAG} {path}: not a plan ({e}); write one with chunk-offload plan ... --budget-gb GB --co-plan --json FILE"
        ) from None


def resolve_plan(args: argparse.Namespace) -> CoPlan:
    """``auto``: `co_plan` under ``--chunk-offload-device-budget``; else the plan file."""
    if args.chunk_offload_plan != "auto":
        plan = load_plan(args.chunk_offload_plan)
    else:
        dims, pipeline = planner_inputs(args)
        planner = StagePlanner(
            dims,
            pipeline,
            min_offload_bytes=args.chunk_offload_min_offload_bytes,
            schedule=args.chunk_offload_schedule,
            group_by=args.chunk_offload_group_by,
            layer_group_bytes=args.chunk_offload_layer_group_bytes,
        )
        plan = co_plan(planner, budget_bytes=args.chunk_offload_device_budget)
    if len(plan.stages) != args.pipeline_model_parallel_size:
        raise ChunkOffloadError(
            f"{_FLAG} {args.chunk_offload_plan}: the plan has {len(plan.stages)} stages, the job "
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}"
        )
    return plan


def apply_plan(args: argparse.Namespace, plan: CoPlan) -> None:
    """Set Megatron's selective recompute on ``args`` as ``plan`` says (before the model is built).

    Refuses a recompute the command line set otherwise (``--recompute-granularity full``, or other
    ``--recompute-modules``): the plan chose them."""
    wanted = list(plan.recompute_modules)
    granularity = getattr(args, "recompute_granularity", None)
    given = list(getattr(args, "recompute_modules", None) or [])
    if granularity == "full" or (granularity == "selective" and sorted(given) != sorted(wanted)):
        typed = "--recompute-granularity full" if granularity == "full" else f"--recompute-modules {' '.join(given)}"
        raise ChunkOffloadError(
            f"{_FLAG} {args.chunk_offload_plan} recomputes {wanted or 'nothing'} but the command line sets {typed}; drop "
            f"the recompute flags (the plan chooses them) or the plan"
        )
    if wanted:
        args.recompute_granularity = "selective"
        args.recompute_modules = wanted


def stage_modules(plan: CoPlan, pp_rank: int) -> list[str]:
    """The offload modules of stage ``pp_rank``."""
    return list(plan.stages[pp_rank].offload_modules)


def describe(plan: CoPlan) -> str:
    """What the plan set, one line (printed once by the launcher)."""
    recompute = " ".join(plan.megatron_args()) or "no recompute"
    stages = "; ".join(f"stage {s.pp_rank}: {','.join(s.offload_modules) or '-'}" for s in plan.stages)
    fits = "fits" if plan.fits else "DOES NOT FIT"
    return f"chunk-offload plan ({fits} {plan.budget_bytes} bytes per stage): {recompute}; offload {stages}"
