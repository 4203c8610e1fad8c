"""The text ``chunk-offload plan`` prints: the model, the bytes per module and chunk, the per-stage
estimate (with the budget's verdict per stage when ``--budget-gb`` is given), the recommendations."""

from __future__ import annotations

from ..core.actions import NOTATION
from .coplan import CoPlan
from .dims import GPTDims
from .estimate import Hardware, PipelineConfig, StageEstimate, StagePlanner
from .group_choice import GroupChoice
from .recommend import Recommendation

__all__ = ["byte_model", "format_plan"]


def byte_model(dims: GPTDims) -> str:
    """Which layer spec the bytes are for, and how far they are measured."""
    extra = " MTP layers: the MTP block measured on CPU, its layer as the decoder's." if dims.mtp_num_layers else ""
    if dims.hybrid_layer_pattern is not None:
        return (
            f"hybrid layers {dims.hybrid_layer_pattern} on Transformer Engine's spec: Mamba layers (M) from megatron-core's "
            "and mamba_ssm's source, unmeasured, FLOPs estimated; the others as Transformer Engine's, from source, unmeasured"
        )
    return _spec_model(dims) + extra


def _spec_model(dims: GPTDims) -> str:
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


def format_plan(
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
        f"{pipeline.num_microbatches} microbatches; schedule policy {planner.schedule}; tensors < {planner.min_offload_bytes} B stay",
        f"offload: {', '.join(modules)}; host link {_link(hardware)}, device {hardware.device_tflops:g} TFLOP/s"
        + (f"; recompute {', '.join(dims.recompute_modules)}" if dims.recompute_modules else ""),
        f"byte model: {byte_model(dims)}",
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
    verdicts = {c.pp_rank: c for c in group_choices or ()}
    rows = []
    for s in stages:
        verdict = verdicts.get(s.pp_rank)
        budget = [] if verdict is None else ["yes" if verdict.fits else "NO", _mb(verdict.over_bytes)]
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
                *budget,
            ]
        )
    header = ["stage", "in flight", "kept", "peak w/o", "peak with", "drop", "copied/iter", "copy", "fwd", "bwd", "hides", "act w/o", "act with"]
    lines += _table(header + (["fits", "over MB"] if verdicts else []), rows)
    lines += [
        "",
        "act w/o / act with: every saved activation of the stage's layers at its peak, without and with offload",
        "(estimate, see chunk_offload.planner.estimate), plus --other-activation-gb.",
    ]
    if verdicts:
        lines += [
            "fits / over MB: whether the stage's activations fit --budget-gb with the groups a device budget "
            "offloads, and by how much the lowest reachable peak exceeds it; why not, below."
        ]
    if recommendations is not None:
        lines += ["", f"budget {recommendations[0].budget_bytes / 1e9:g} GB per stage:"]
        lines += [f"  {r.describe()}" for r in recommendations]
    if group_choices is not None:
        lines += ["", "per group, as a device budget chooses at run time (offload groups of single chunks):"]
        lines += [f"  {c.describe()}" for c in group_choices]
    lines += ["", NOTATION]
    return "\n".join(lines) + "\n"


def _link(hardware: Hardware) -> str:
    if hardware.offload_gbps == hardware.reload_gbps:
        return f"{hardware.offload_gbps:g} GB/s"
    return f"{hardware.offload_gbps:g} GB/s to host, {hardware.reload_gbps:g} GB/s back"


def format_co_plan(plan: CoPlan) -> str:
    """The keep / offload / recompute choice per stage (`co_plan`), with the flags that apply it."""
    recompute = ", ".join(plan.recompute_modules) or "nothing"
    lines = [
        "",
        f"co-plan for a budget of {_mb(plan.budget_bytes)} MB per stage: recompute {recompute} (one setting for the model)"
        + ("" if plan.fits else "; DOES NOT FIT"),
    ]
    rows = [
        [str(s.pp_rank), ",".join(s.offload_modules) or "-", "yes" if s.fits else "NO", _mb(s.predicted_peak_bytes), f"{s.predicted_extra_time_ms:.3f}"]
        for s in plan.stages
    ]
    lines += _table(["stage", "offload", "fits", "peak MB", "extra ms/iter"], rows)
    if plan.megatron_args():
        lines.append("Megatron flags: " + " ".join(plan.megatron_args()))
    lines.append("why: see co_plan.stages[i].reasons in the JSON (--json)")
    return "\n".join(lines) + "\n"
