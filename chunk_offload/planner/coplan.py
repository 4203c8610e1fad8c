"""`co_plan`: per stage and module, keep, offload or recompute under a device budget.

NOTE [Co-planning]
Megatron's selective recompute is one setting of the whole model (``--recompute-modules``), while
offload modules can differ per pipeline stage (each rank attaches its own). `co_plan` therefore
tries every allowed recompute set R (subsets of ``recompute_candidates``, `RECOMPUTE_MODULES`)
and, for each R, every allowed offload set O per stage (subsets of ``offload_candidates``;
`module_names.combination_problem` refuses what megatron-core refuses, and a module R recomputes
is never offloaded: it saves nothing), predicts each stage's activation peak (`StagePlanner`, the
byte model with R) and its extra time per iteration:

- recompute: the forward FLOPs R runs again in backward (`layer_recompute_flops`) at
  ``Hardware.device_tflops``, for every layer and microbatch of the stage;
- offload: per layer and copied chunk, the offload copy time not covered by the layer's forward
  plus the reload time not covered by its backward (``d2h_gbps`` and ``h2d_gbps`` each where it
  applies); copies that hide cost nothing.

Per stage it keeps the fitting O of least extra time (then fewest bytes copied, then fewest
modules); across R, the one whose slowest stage is fastest, since a pipeline runs at the pace of
its slowest stage (then fewest recomputed modules). When no R makes every stage fit, the R with
the most fitting stages and then the lowest worst overshoot is reported with ``fits: false``.
A model, not a measurement: the byte model is measured on CPU, the times are not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from itertools import combinations
from typing import Sequence

from ..core.errors import ChunkOffloadError
from ..module_names import OFFLOAD_MODULE_NAMES, canonical_modules, combination_problem
from .dims import RECOMPUTE_MODULES
from .estimate import StageEstimate, StagePlanner
from .model import layer_backward_flops, layer_forward_flops, layer_offload_groups, layer_recompute_flops

__all__ = ["CoPlan", "StagePlan", "co_plan"]

_MAX_CANDIDATES = 8


@dataclass(kw_only=True)
class StagePlan:
    """One stage's choice: what it offloads and recomputes, its predicted peak and extra time, and why."""

    pp_rank: int
    offload_modules: list[str]
    recompute_modules: list[str]
    fits: bool
    predicted_peak_bytes: int
    predicted_extra_time_ms: float
    reasons: dict[str, str] = field(default_factory=dict)
    """Module -> why it is kept, offloaded or recomputed on this stage."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(kw_only=True)
class CoPlan:
    """The plan of every stage under one device budget, and the Megatron flags that apply it."""

    budget_bytes: int
    recompute_modules: list[str]
    """Megatron's selective recompute modules (one setting for the whole model)."""
    stages: list[StagePlan]

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def megatron_args(self) -> list[str]:
        """The Megatron-LM flags that set the recompute (empty without recompute)."""
        if not self.recompute_modules:
            return []
        return ["--recompute-granularity", "selective", "--recompute-modules", *self.recompute_modules]

    def to_dict(self) -> dict:
        return {
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "recompute_modules": self.recompute_modules,
            "megatron_args": self.megatron_args(),
            "stages": [s.to_dict() for s in self.stages],
        }


def co_plan(
    planner: StagePlanner,
    *,
    budget_bytes: int,
    offload_candidates: Sequence[str] | None = None,
    recompute_candidates: Sequence[str] | None = None,
) -> CoPlan:
    """The keep / offload / recompute choice per stage that fits ``budget_bytes`` at the least
    predicted extra time (NOTE [Co-planning]). ``planner`` gives the model, schedule, hardware and
    threshold (its ``dims.recompute_modules`` must be empty: the plan chooses them)."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ChunkOffloadError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
    if planner.dims.recompute_modules:
        raise ChunkOffloadError(f"co_plan chooses the recompute modules; give a planner without them, got {planner.dims.recompute_modules}")
    dims = planner.dims
    if offload_candidates is None:  # every module the model has but moe_act (a module only under TE's activation)
        offload = [m for m in OFFLOAD_MODULE_NAMES if m != "moe_act" and any(m in dims.modules_of(i) for i in range(dims.num_layers))]
    else:
        offload = canonical_modules(offload_candidates)
    recompute = _recompute_candidates(dims, recompute_candidates)
    if len(offload) > _MAX_CANDIDATES:
        raise ChunkOffloadError(f"at most {_MAX_CANDIDATES} offload candidates (2^n sets are tried), got {len(offload)}: {offload}")
    best: tuple | None = None
    for r in range(len(recompute) + 1):
        for chosen in combinations(recompute, r):
            stages = _stages_for(planner, list(chosen), offload, budget_bytes)
            fitting = sum(s.fits for s in stages)
            worst_over = max(s.predicted_peak_bytes - budget_bytes for s in stages)
            worst_time = max(s.predicted_extra_time_ms for s in stages)
            key = (-fitting, max(worst_over, 0), worst_time, len(chosen))
            if best is None or key < best[0]:
                best = (key, list(chosen), stages)
    assert best is not None
    return CoPlan(budget_bytes=budget_bytes, recompute_modules=best[1], stages=best[2])


def _recompute_candidates(dims, given: Sequence[str] | None) -> list[str]:
    modelled = [m for m in RECOMPUTE_MODULES if m != "moe" or dims.num_experts is not None]
    if given is None:
        return modelled
    unknown = [m for m in given if m not in modelled]
    if unknown:
        raise ChunkOffloadError(f"recompute candidates {unknown} not modelled for this model; choose from {modelled}")
    return list(dict.fromkeys(given))


def _stages_for(planner: StagePlanner, recompute: list[str], candidates: list[str], budget: int) -> list[StagePlan]:
    """Per stage, the best offload set under recompute set ``recompute``."""
    dims = dataclasses.replace(planner.dims, recompute_modules=tuple(recompute))
    under = StagePlanner(dims, planner.pipeline, hardware=planner.hardware, min_offload_bytes=planner.min_offload_bytes,
                         schedule=planner.schedule, other_activation_bytes=planner.other_activation_bytes,
                         group_by=planner.group_by, layer_group_bytes=planner.layer_group_bytes)  # fmt: skip
    allowed = [m for m in candidates if not all(dims.recomputed(i, m) for i in range(dims.num_layers) if m in dims.modules_of(i))]
    subsets = [list(c) for k in range(len(allowed) + 1) for c in combinations(allowed, k) if combination_problem(c, recompute) is None]
    estimates = {tuple(s): under.estimate(s) for s in subsets}
    recompute_ms = [_recompute_ms(under, r) for r in range(under.pipeline.pipeline_parallel)]
    plans = []
    for r in range(under.pipeline.pipeline_parallel):
        scored = []
        for subset, per_stage in estimates.items():
            stage = per_stage[r]
            extra = recompute_ms[r] + _offload_ms(under, stage)
            fits = stage.peak_with_offload_bytes <= budget
            scored.append(((not fits, extra if fits else stage.peak_with_offload_bytes, stage.bytes_offloaded, len(subset)), subset, stage, extra))
        _, subset, stage, extra = min(scored, key=lambda item: item[0])
        plans.append(_stage_plan(under, r, list(subset), recompute, stage, extra, budget, candidates))
    return plans


def _recompute_ms(planner: StagePlanner, pp_rank: int) -> float:
    dims, hardware = planner.dims, planner.hardware
    flops = sum(layer_recompute_flops(dims, layer) for chunk in planner.layers[pp_rank] for layer in chunk)
    return 1e3 * hardware.compute_seconds(flops * planner.pipeline.num_microbatches)


def _offload_ms(planner: StagePlanner, stage: StageEstimate) -> float:
    """Copy time not hidden by compute, per iteration: per layer of each copied chunk, the offload
    beyond the layer's forward and the reload beyond its backward (NOTE [Co-planning])."""
    if not stage.modules:
        return 0.0
    dims, hardware = planner.dims, planner.hardware
    kept = {tuple(c) for c in stage.kept_chunks}
    total = 0.0
    for vp, layers in enumerate(planner.layers[stage.pp_rank]):
        copied = sum(1 for m in range(planner.pipeline.num_microbatches) if (m, vp) not in kept)
        for i, layer in enumerate(layers):
            receives = i == 0 and (stage.pp_rank, vp) != (0, 0)
            groups = planner.as_groups(
                layer_offload_groups(dims, layer, stage.modules, min_offload_bytes=planner.min_offload_bytes, receives_input=receives)
            )
            moved = sum(g.nbytes - g.kept_bytes for g in groups)
            out = hardware.copy_seconds(moved) - hardware.compute_seconds(layer_forward_flops(dims, layer))
            back = hardware.reload_seconds(moved) - hardware.compute_seconds(layer_backward_flops(dims, layer))
            total += copied * (max(out, 0.0) + max(back, 0.0))
    return 1e3 * total


def _stage_plan(planner, pp_rank, offload, recompute, stage, extra_ms, budget, candidates) -> StagePlan:
    peak = stage.peak_with_offload_bytes
    fits = peak <= budget
    reasons: dict[str, str] = {}
    recompute_ms = _recompute_ms(planner, pp_rank)
    for module in recompute:
        reasons[module] = (
            f"recomputed (with {', '.join(recompute)}: {recompute_ms:.3f} ms of forward again per iteration on this "
            "stage): only its inputs stay saved"
        )
    for module in offload:
        reasons[module] = f"offloaded: {stage.module_bytes_per_layer.get(module, 0)} bytes per layer to host, copies {'hidden' if stage.hides else 'not all hidden'}"
    for module in candidates:
        if module in reasons:
            continue
        if fits and not offload and not recompute:
            reasons[module] = "kept: the stage fits the budget without moving anything"
        elif fits:
            reasons[module] = "kept: the stage fits without it, and moving it would only add time"
        else:
            reasons[module] = "kept: moving it does not lower this stage's peak (or is refused with the recompute)"
    why = "fits" if fits else f"over the budget by {peak - budget} bytes even with every allowed choice"
    reasons["stage"] = why
    return StagePlan(
        pp_rank=pp_rank,
        offload_modules=offload,
        recompute_modules=list(recompute),
        fits=fits,
        predicted_peak_bytes=peak,
        predicted_extra_time_ms=round(extra_ms, 6),
        reasons=reasons,
    )
