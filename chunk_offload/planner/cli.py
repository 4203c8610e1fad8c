"""``chunk-offload plan``: the planner on the command line.

Example (Llama-3-8B-like shape, tensor parallel 2 with sequence parallelism, 4 stages x 2
virtual stages, 8 microbatches)::

    chunk-offload plan --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 \\
        --num-attention-heads 32 --num-query-groups 8 --seq-length 4096 --micro-batch-size 1 \\
        --normalization RMSNorm --swiglu --position-embedding-type rope --tp 2 --sequence-parallel \\
        --pp 4 --vpp 2 --num-microbatches 8 --modules qkv_linear,core_attn --budget-gb 60

prints a table per stage (bytes per module per layer and per chunk, on one tensor-parallel rank, and
per chunk the bytes held elsewhere, which stay on device uncopied; chunks in flight at the peak, the predicted peak without and with offload and the drop, copy against compute time per
layer) and, with ``--budget-gb``, the cheapest module set per stage that fits without stalls,
and the groups of single chunks a device budget makes each stage offload (the choice training
with ``--chunk-offload-device-budget`` makes from the same bytes: `choose_groups`).
``--json PATH`` writes the same as JSON. Byte counts are decimal (1 GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Sequence

from ..core.errors import ChunkOffloadError
from ..core.option_table import option
from ..option_flags import argparse_keywords
from .estimate import GB, POLICY_SCHEDULES, Hardware, PipelineConfig, StageEstimate, StagePlanner
from ..module_names import ALIASES, OFFLOAD_MODULE_NAMES, canonical_modules, check_combination
from .dims import ATTENTION_KERNELS, ATTENTIONS, RECOMPUTE_MODULES, DTYPE_BYTES, NORMALIZATIONS, POSITION_EMBEDDINGS, TRANSFORMER_IMPLS, GPTDims
from .group_choice import GroupChoice, choose_groups
from .model import check_modelled
from .cli_checks import check_args, given_flags, name_flags
from .cli_text import byte_model, format_co_plan, format_plan
from .coplan import co_plan
from .recommend import recommend

__all__ = ["build_parser", "main"]

_PROG = "chunk-offload"


def build_parser() -> argparse.ArgumentParser:
    """The ``chunk-offload`` argument parser (subcommand ``plan``)."""
    parser = argparse.ArgumentParser(prog=_PROG, description="chunk-offload tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser(
        "plan",
        help="predict per-stage activation bytes, drop and copy time; recommend module sets for a budget",
        description=__doc__.split("\n\n")[0],
    )
    model = plan.add_argument_group("model (megatron-core names)")
    model.add_argument("--num-layers", type=int, required=True)
    model.add_argument("--hidden-size", type=int, required=True)
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    model.add_argument("--num-attention-heads", type=int, required=True)
    model.add_argument("--num-query-groups", type=int, default=None, help="grouped-query attention; default: heads")
    model.add_argument("--seq-length", type=int, required=True)
    model.add_argument("--micro-batch-size", type=int, default=1)
    model.add_argument("--num-experts", type=int, default=None, help="MoE experts per MoE layer")
    model.add_argument("--moe-router-topk", type=int, default=2)
    model.add_argument("--moe-layer-freq", default="1", help="every N-th layer is MoE, or one 0/1 per layer: 1,0,1,0")
    model.add_argument("--expert-model-parallel-size", "--ep", dest="expert_parallel", type=int, default=1)
    model.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    model.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cpu: torch's CPU norms (CPU training)"
    )
    model.add_argument("--normalization", choices=list(NORMALIZATIONS), default="LayerNorm")
    model.add_argument("--swiglu", action="store_true", help="gated MLP with SiLU (fc1 is 2 x ffn wide)")
    model.add_argument(
        "--no-bias-swiglu-fusion",
        dest="bias_swiglu_fusion",
        action="store_false",
        help="with --swiglu: megatron's unfused SwiGLU, which saves more than the fused one",
    )
    model.add_argument("--position-embedding-type", choices=list(POSITION_EMBEDDINGS), default="learned_absolute")
    model.add_argument("--rope", action="store_true", help="same as --position-embedding-type rope")
    model.add_argument(
        "--attention",
        choices=list(ATTENTIONS),
        default="sdpa",
        help="core attention of the local spec: sdpa (torch's scaled_dot_product_attention, flash-style; default) "
        "or local (megatron's DotProductAttention, which saves the s x s softmax)",
    )
    model.add_argument(
        "--transformer-impl",
        choices=list(TRANSFORMER_IMPLS),
        default="local",
        help="megatron's layer spec: local (default) or transformer_engine (fused norm + linear, TE's "
        "DotProductAttention; modelled from TE's source, unmeasured; FP8 activations are not modelled)",
    )
    model.add_argument(
        "--attention-kernel",
        choices=sorted({k for kernels in ATTENTION_KERNELS.values() for k in kernels}),
        default="flash",
        help="CUDA kernel of the flash-style attention: flash or efficient (torch SDPA), flash or fused "
        "(TE: flash-attn or cuDNN); from source, unmeasured (default flash)",
    )
    model.add_argument(
        "--mtp-num-layers", type=int, default=None, help="Multi-Token Prediction layers, after the decoder on the last stage"
    )
    model.add_argument(
        "--hybrid-layer-pattern",
        "--hybrid-override-pattern",
        default=None,
        help="hybrid (Mamba) model: one symbol per layer, M Mamba, * attention, - MLP, E MoE (e.g. M*M-); needs "
        "--transformer-impl transformer_engine; Mamba layers from source, unmeasured",
    )
    model.add_argument("--mamba-state-dim", type=int, default=128)
    model.add_argument("--mamba-head-dim", type=int, default=64)
    model.add_argument("--mamba-num-groups", type=int, default=8)
    model.add_argument("--mamba-num-heads", type=int, default=None, help="default 2 x hidden / --mamba-head-dim")
    parallel = plan.add_argument_group("tensor parallel (bytes are per tensor-parallel rank)")
    parallel.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1)
    parallel.add_argument("--sequence-parallel", action="store_true", help="megatron's sequence parallelism (needs --tp >= 2)")
    pipe = plan.add_argument_group("pipeline")
    pipe.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, default=1)
    pipe.add_argument("--virtual-pipeline-model-parallel-size", "--vpp", dest="vpp", type=int, default=None)
    pipe.add_argument("--num-microbatches", type=int, required=True)
    pipe.add_argument("--microbatch-group-size-per-vp-stage", type=int, default=None)
    off = plan.add_argument_group("offload")
    off.add_argument(
        "--modules",
        default=None,
        help=f"comma-separated offload modules from {list(OFFLOAD_MODULE_NAMES) + sorted(ALIASES)}; "
        "default every one the model has but moe_act",
    )
    min_bytes = option("min-offload-bytes")
    off.add_argument("--min-offload-bytes", **argparse_keywords(min_bytes, dest="min_offload_bytes"))
    off.add_argument("--group-by", **argparse_keywords(option("group-by"), dest="group_by"))
    off.add_argument("--layer-group-bytes", **argparse_keywords(option("layer-group-bytes"), dest="layer_group_bytes"))
    schedule = option("schedule")
    off.add_argument(
        "--schedule",
        **argparse_keywords(
            schedule,
            dest="schedule",
            help="the launcher's --chunk-offload-schedule: plan (default) keeps chunks whose backward follows at once "
            "and prefetches by plan; group-start offloads every chunk",
        ),
    )
    off.add_argument(
        "--policy", choices=sorted(POLICY_SCHEDULES), default=None, help="deprecated: use --schedule (all is group-start)"
    )
    off.add_argument(
        "--recompute-modules",
        nargs="+",
        choices=list(RECOMPUTE_MODULES),
        default=None,
        help="megatron's selective recompute of these modules (--recompute-granularity selective), for the estimate",
    )
    off.add_argument(
        "--co-plan",
        action="store_true",
        help="with --budget-gb: choose per stage and module keep, offload or recompute (the recompute one setting "
        "for the whole model) at the least predicted extra time; the launcher's --chunk-offload-plan auto",
    )
    hw = plan.add_argument_group("hardware")
    hw.add_argument("--host-bandwidth-gbs", type=float, default=25.0, help="device-host GB/s per direction (default 25)")
    hw.add_argument("--d2h-gbps", type=float, default=None, help="device-to-host (offload) GB/s; default --host-bandwidth-gbs")
    hw.add_argument("--h2d-gbps", type=float, default=None, help="host-to-device (reload) GB/s; default --host-bandwidth-gbs")
    hw.add_argument(
        "--device-tflops", type=float, default=400.0, help="sustained TFLOP/s (default 400, ~40%% of an H100's dense BF16 peak)"
    )
    budget = plan.add_argument_group("budget")
    budget.add_argument("--budget-gb", type=float, default=None, help="activation memory per stage; recommend module sets")
    budget.add_argument(
        "--other-activation-gb", type=float, default=0.0, help="added to each stage's peak: embeddings, loss, buffers (default 0)"
    )
    plan.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="also write the result as JSON")
    parser.plan_parser = plan  # for the usage checks, which name the plan's flags
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (``argv`` None: ``sys.argv[1:]``); returns the exit status.

    Invalid values print the reason to stderr and return 2; malformed flags exit through
    argparse (status 2 as well).
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    plan_parser = parser.plan_parser
    given = given_flags(plan_parser, argv)
    check_args(plan_parser, args, given)
    try:
        result = _plan(args)
    except ChunkOffloadError as e:
        print(f"{_PROG} {args.command}: error: {name_flags(str(e), plan_parser, given)}", file=sys.stderr)
        return 2
    sys.stdout.write(result.text)
    if args.json_path is not None:
        with open(args.json_path, "w") as f:
            json.dump(result.data, f, indent=2)
            f.write("\n")
    return 0


class _Result:
    def __init__(self, text: str, data: dict) -> None:
        self.text = text
        self.data = data


def _moe_layer_freq(text: str) -> int | tuple[int, ...]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ChunkOffloadError(f"--moe-layer-freq takes an int or comma-separated 0/1 per layer, got {text!r}") from None
    return values[0] if len(values) == 1 else tuple(values)


def _plan(args: argparse.Namespace) -> _Result:
    for flag, value in (("--budget-gb", args.budget_gb), ("--other-activation-gb", args.other_activation_gb)):
        if value is not None and value < 0:
            raise ChunkOffloadError(f"{flag} must be >= 0, got {value}")
    dims = GPTDims(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        num_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_layer_freq=_moe_layer_freq(args.moe_layer_freq),
        expert_parallel=args.expert_parallel,
        dtype=args.dtype,
        device=args.device,
        normalization=args.normalization,
        swiglu=args.swiglu,
        bias_swiglu_fusion=args.bias_swiglu_fusion,
        position_embedding_type=args.position_embedding_type,
        tensor_parallel=args.tp,
        sequence_parallel=args.sequence_parallel,
        attention=args.attention,
        attention_kernel=args.attention_kernel,
        transformer_impl=args.transformer_impl,
        recompute_modules=tuple(args.recompute_modules or ()),
        mtp_num_layers=args.mtp_num_layers,
        hybrid_layer_pattern=args.hybrid_layer_pattern,
        mamba_state_dim=args.mamba_state_dim,
        mamba_head_dim=args.mamba_head_dim,
        mamba_num_groups=args.mamba_num_groups,
        mamba_num_heads=args.mamba_num_heads,
    )
    pipeline = PipelineConfig(
        pipeline_parallel=args.pp,
        virtual_pipeline=args.vpp,
        num_microbatches=args.num_microbatches,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
    )
    hardware = Hardware(
        host_bandwidth_gbs=args.host_bandwidth_gbs, device_tflops=args.device_tflops, d2h_gbps=args.d2h_gbps, h2d_gbps=args.h2d_gbps
    )
    planner = StagePlanner(
        dims,
        pipeline,
        hardware=hardware,
        min_offload_bytes=args.min_offload_bytes,
        schedule=args.schedule,
        other_activation_bytes=round(args.other_activation_gb * GB),
        group_by=args.group_by,
        layer_group_bytes=args.layer_group_bytes,
    )
    present = [m for m in OFFLOAD_MODULE_NAMES if any(m in dims.modules_of(i) for i in range(dims.num_layers))]
    if args.modules is None:
        modules = [m for m in present if m != "moe_act"]
    else:
        modules = canonical_modules(args.modules)
        check_combination(modules, args.recompute_modules or (), modules_flag="--modules", recompute_flag="--recompute-modules")
        check_modelled(modules)
        missing = [m for m in modules if m not in present]
        if missing:
            raise ChunkOffloadError(f"module(s) {missing} not in this model; it has {present}")
    stages = planner.estimate(modules)
    recommendations = group_choices = plan = None
    if args.budget_gb is not None:
        recommendations = recommend(planner, budget_bytes=round(args.budget_gb * GB), candidates=modules)
        group_choices = choose_groups(planner, stages, budget_bytes=round(args.budget_gb * GB))
    if args.co_plan:
        plan = co_plan(planner, budget_bytes=round(args.budget_gb * GB), offload_candidates=modules)
    text = format_plan(dims, pipeline, hardware, planner, modules, stages, recommendations, group_choices)
    if plan is not None:
        text += format_co_plan(plan)
    data = {
        "model": asdict(dims),
        "byte_model": byte_model(dims),
        "pipeline": asdict(pipeline),
        "hardware": asdict(hardware),
        "modules": modules,
        "min_offload_bytes": planner.min_offload_bytes,
        "group_by": planner.group_by,
        "layer_group_bytes": planner.layer_group_bytes,
        "schedule_policy": planner.schedule,
        "schedule": planner.plans[0].source,
        "stages": [_stage_dict(s, group_choices) for s in stages],
        "recommendations": None if recommendations is None else [r.to_dict() for r in recommendations],
        "group_choices": None if group_choices is None else [c.to_dict() for c in group_choices],
        "co_plan": None if plan is None else plan.to_dict(),
    }
    return _Result(text, data)


def _stage_dict(stage: StageEstimate, group_choices: list[GroupChoice] | None) -> dict:
    """The stage's estimate, with ``budget`` (None without ``--budget-gb``): fits, bytes over, why."""
    data = stage.to_dict()
    choice = None if group_choices is None else next(c for c in group_choices if c.pp_rank == stage.pp_rank)
    data["budget"] = None if choice is None else {
        "budget_bytes": choice.budget_bytes,
        "fits": choice.fits,
        "over_bytes": choice.over_bytes,
        "reason": choice.reason,
    }
    return data
