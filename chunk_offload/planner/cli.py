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
import math
import os
import sys
from dataclasses import asdict
from typing import Sequence

from ..core.errors import ChunkOffloadError
from .estimate import GB, Hardware, PipelineConfig, StageEstimate, StagePlanner
from ..module_names import ALIASES, OFFLOAD_MODULE_NAMES, canonical_modules
from .dims import ATTENTION_KERNELS, ATTENTIONS, DTYPE_BYTES, NORMALIZATIONS, POSITION_EMBEDDINGS, TRANSFORMER_IMPLS, GPTDims
from .group_choice import GroupChoice, choose_groups
from .recommend import Recommendation, recommend

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
    model.add_argument(
        "--rope", dest="position_embedding_type", action="store_const", const="rope", help="same as --position-embedding-type rope"
    )
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
    off.add_argument("--min-offload-bytes", type=int, default=1 << 20, help="saved tensors smaller than this stay (default 1 MiB)")
    off.add_argument(
        "--policy",
        choices=["plan", "all"],
        default="plan",
        help="plan: keep chunks whose backward follows at once, prefetch by plan; all: offload every chunk",
    )
    hw = plan.add_argument_group("hardware")
    hw.add_argument("--host-bandwidth-gbs", type=float, default=25.0, help="device-host GB/s per direction (default 25)")
    hw.add_argument(
        "--device-tflops", type=float, default=400.0, help="sustained TFLOP/s (default 400, ~40%% of an H100's dense BF16 peak)"
    )
    budget = plan.add_argument_group("budget")
    budget.add_argument("--budget-gb", type=float, default=None, help="activation memory per stage; recommend module sets")
    budget.add_argument(
        "--other-activation-gb", type=float, default=0.0, help="added to each stage's peak: embeddings, loss, buffers (default 0)"
    )
    plan.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="also write the result as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (``argv`` None: ``sys.argv[1:]``); returns the exit status.

    Invalid values print the reason to stderr and return 2; malformed flags exit through
    argparse (status 2 as well).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    try:
        result = _plan(args)
    except ChunkOffloadError as e:
        print(f"{_PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(result.text)
    if args.json_path is not None:
        with open(args.json_path, "w") as f:
            json.dump(result.data, f, indent=2)
            f.write("\n")
    return 0


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit status 2) found before anything is computed."""
    numbers = (
        ("--budget-gb", args.budget_gb),
        ("--other-activation-gb", args.other_activation_gb),
        ("--host-bandwidth-gbs", args.host_bandwidth_gbs),
        ("--device-tflops", args.device_tflops),
    )
    for flag, value in numbers:
        if value is not None and not math.isfinite(value):
            parser.error(f"argument {flag}: must be a finite number, got {value}")
    if args.json_path is not None:
        folder = os.path.dirname(os.path.abspath(args.json_path))
        if not os.path.isdir(folder):
            parser.error(f"argument --json: folder {folder!r} of {args.json_path!r} does not exist")
        if os.path.isdir(args.json_path):
            parser.error(f"argument --json: {args.json_path!r} is a folder; give a file path")
    kernels = ATTENTION_KERNELS[args.transformer_impl]
    if args.attention_kernel not in kernels:
        parser.error(
            f"argument --attention-kernel: {args.attention_kernel!r} is not a kernel of --transformer-impl "
            f"{args.transformer_impl}; choose from {list(kernels)}"
        )


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
    )
    pipeline = PipelineConfig(
        pipeline_parallel=args.pp,
        virtual_pipeline=args.vpp,
        num_microbatches=args.num_microbatches,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
    )
    hardware = Hardware(host_bandwidth_gbs=args.host_bandwidth_gbs, device_tflops=args.device_tflops)
    planner = StagePlanner(
        dims,
        pipeline,
        hardware=hardware,
        min_offload_bytes=args.min_offload_bytes,
        policy=args.policy,
        other_activation_bytes=round(args.other_activation_gb * GB),
    )
    present = [m for m in OFFLOAD_MODULE_NAMES if any(m in dims.modules_of(i) for i in range(dims.num_layers))]
    if args.modules is None:
        modules = [m for m in present if m != "moe_act"]
    else:
        modules = canonical_modules(args.modules)
        missing = [m for m in modules if m not in present]
        if missing:
            raise ChunkOffloadError(f"module(s) {missing} not in this model; it has {present}")
    stages = planner.estimate(modules)
    recommendations = group_choices = None
    if args.budget_gb is not None:
        recommendations = recommend(planner, budget_bytes=round(args.budget_gb * GB), candidates=modules)
        group_choices = choose_groups(planner, stages, budget_bytes=round(args.budget_gb * GB))
    text = _format(dims, pipeline, hardware, planner, modules, stages, recommendations, group_choices)
    data = {
        "model": asdict(dims),
        "byte_model": _byte_model(dims),
        "pipeline": asdict(pipeline),
        "hardware": asdict(hardware),
        "modules": modules,
        "min_offload_bytes": planner.min_offload_bytes,
        "policy": planner.policy,
        "schedule": planner.plans[0].source,
        "stages": [s.to_dict() for s in stages],
        "recommendations": None if recommendations is None else [r.to_dict() for r in recommendations],
        "group_choices": None if group_choices is None else [c.to_dict() for c in group_choices],
    }
    return _Result(text, data)


def _byte_model(dims: GPTDims) -> str:
    """Which layer spec the bytes are for, and how far they are measured."""
    if dims.transformer_engine:
        return (
            f"Transformer Engine's spec (norms fused into qkv_linear / mlp_fc1, {dims.attention_kernel} attention): "
            "from source, unmeasured; FP8 activations not modelled"
        )
    if dims.attention == "local":
        return "megatron-core's local spec with its DotProductAttention (core_attn holds the s x s softmax); measured on CPU"
    where = "measured on CPU" if dims.device == "cpu" else f"core_attn from source, unmeasured ({dims.attention_kernel} kernel)"
    return f"megatron-core's local spec with torch's SDPA (core_attn: q, k, v, output, log-sum-exp); {where}"


def _mb(nbytes: int | float) -> str:
    return f"{nbytes / 1e6:.2f}"


def _gb(nbytes: int | float) -> str:
    return f"{nbytes / 1e9:.3f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _format(
    dims: GPTDims,
    pipeline: PipelineConfig,
    hardware: Hardware,
    planner: StagePlanner,
    modules: list[str],
    stages: list[StageEstimate],
    recommendations: list[Recommendation] | None,
    group_choices: list[GroupChoice] | None = None,
) -> str:
    moe = f", {dims.num_experts} experts top-{dims.moe_router_topk} EP={dims.expert_parallel}" if dims.num_experts else ""
    mlp = ("SwiGLU" + ("" if dims.bias_swiglu_fusion else " (unfused)")) if dims.swiglu else "GELU"
    lines = [
        f"model: {dims.num_layers} layers, hidden {dims.hidden_size}, ffn {dims.ffn}, {dims.num_attention_heads} heads "
        f"({dims.query_groups} query groups), seq {dims.seq_length}, micro batch {dims.micro_batch_size}, {dims.dtype}{moe}",
        f"layers: {dims.normalization}, {mlp}, {dims.position_embedding_type} positions; "
        f"TP={dims.tensor_parallel}{' with sequence parallel' if dims.sequence_parallel else ''} (bytes and FLOPs per TP rank)",
        f"schedule: {planner.plans[0].source}, PP={pipeline.pipeline_parallel} VPP={pipeline.vp_size}, "
        f"{pipeline.num_microbatches} microbatches; policy {planner.policy}; tensors < {planner.min_offload_bytes} B stay",
        f"offload: {', '.join(modules)}; host link {hardware.host_bandwidth_gbs:g} GB/s, device {hardware.device_tflops:g} TFLOP/s",
        f"byte model: {_byte_model(dims)}",
        "",
        "saved bytes per layer and per chunk (MB, one microbatch):",
    ]
    rows = []
    for s in stages:
        for vp, chunk in enumerate(s.layers):
            per = s.chunk_module_bytes[vp]
            rows.append(
                [str(s.pp_rank), str(vp), f"{chunk[0]}-{chunk[-1]}"]
                + [f"{_mb(s.module_bytes_per_layer[m])}/{_mb(per[m])}" if m in per else "-" for m in modules]
                + [_mb(sum(s.group_kept_bytes[vp]))]
            )
    lines += _table(["stage", "vp", "layers"] + [f"{m} layer/chunk" for m in modules] + ["held elsewhere/chunk"], rows)
    lines += ["held elsewhere: saved bytes another reference keeps on device, kept there uncopied (NOTE [Storages held elsewhere])."]
    lines += ["", "per stage (GB; peaks of the offload modules' saved bytes; copy, forward and backward compute per layer in ms):"]
    rows = []
    for s in stages:
        rows.append(
            [
                str(s.pp_rank),
                str(s.chunks_in_flight_peak),
                str(len(s.kept_chunks)),
                _gb(s.peak_saved_bytes),
                _gb(s.peak_resident_bytes),
                _gb(s.drop),
                _gb(s.bytes_offloaded),
                f"{s.copy_seconds_per_layer * 1e3:.3f}",
                f"{s.compute_seconds_per_layer * 1e3:.3f}",
                f"{s.backward_compute_seconds_per_layer * 1e3:.3f}",
                "yes" if s.hides else "NO",
                _gb(s.peak_without_offload_bytes),
                _gb(s.peak_with_offload_bytes),
            ]
        )
    lines += _table(
        ["stage", "in flight", "kept", "peak w/o", "peak with", "drop", "copied/iter", "copy", "fwd", "bwd", "hides", "act w/o", "act with"],
        rows,
    )
    lines += [
        "",
        "act w/o / act with: every saved activation of the stage's layers at its peak, without and with offload",
        "(estimate, see chunk_offload.planner.estimate), plus --other-activation-gb.",
    ]
    if recommendations is not None:
        lines += ["", f"budget {recommendations[0].budget_bytes / 1e9:g} GB per stage:"]
        lines += [f"  {r.describe()}" for r in recommendations]
    if group_choices is not None:
        lines += ["", "per group, as a device budget chooses at run time (offload groups of single chunks):"]
        lines += [f"  {c.describe()}" for c in group_choices]
    return "\n".join(lines) + "\n"
