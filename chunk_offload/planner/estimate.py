"""Per-stage estimate: bytes per module, chunks in flight, predicted drop, copy against compute.

For each pipeline rank, `estimate_stages`:

1. places the layers: chunk v of stage r holds the global layers from
   ``v * L / vp + r * L / (pp * vp)`` on, ``L / (pp * vp)`` of them (Megatron's even split);
2. lists the offload groups of one chunk in forward order with their bytes and, of those, the
   bytes held elsewhere, which stay on device (`model.layer_offload_groups`);
3. takes the rank's plan from Megatron's own schedule tables (`megatron_plan`) and replays the
   engine's accounting over it (`chunk_offload.schedule.simulate`, the held bytes as its
   ``kept_bytes``): the peak of the offload modules' saved bytes without offload, with offload,
   the drop, the bytes copied;
4. compares, for the stage's worst layer, the time to copy what it offloads over the host link
   with the time its forward computes (`Hardware`): the copies hide when copy <= compute.

Everything is per tensor-parallel rank (one device): with ``GPTDims.tensor_parallel`` > 1 the
bytes and FLOPs are one rank's share (NOTE [Byte model] in ``model.py``).

NOTE [Stage activation peak]: for the memory budget the planner also estimates everything the
stage's layers save (`model.layer_saved_bytes`, one group per layer, replayed without offload
over the same plan): ``activation_peak_bytes``. With offload it estimates
``activation_peak_bytes - drop``: exact when both peaks fall on the same moment (the usual case,
when most chunks are in flight), an estimate otherwise. Embeddings, the output layer and loss,
communication buffers and the allocator's workspace are not modelled: pass them as
``other_activation_bytes``. Weights, gradients and optimizer state are outside the budget.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal, Sequence

from ..core import ChunkOffloadError, OffloadConfig
from ..core.option_table import check_value, config_default, option
from ..schedule import PlanPolicy, Simulation, simulate
from ..module_names import canonical_modules
from .config import GB, Hardware, PipelineConfig
from .dims import GPTDims
from .model import (
    LayerGroup,
    check_modelled,
    layer_backward_flops,
    layer_forward_flops,
    layer_offload_groups,
    layer_saved_bytes,
)
from .grouping import joined_groups, merged_layer_group

__all__ = ["GB", "Hardware", "PipelineConfig", "StageEstimate", "StagePlanner", "estimate_stages", "stage_layers"]

_MIN_OFFLOAD_BYTES = config_default("OffloadConfig.min_offload_bytes")
POLICY_SCHEDULES = {"plan": "plan", "all": "group-start"}
"""The deprecated ``policy`` values and the ``schedule`` each is."""

@dataclass(kw_only=True)
class StageEstimate:
    """The prediction for one pipeline stage on one tensor-parallel rank (byte counts are per microbatch unless named otherwise)."""

    pp_rank: int
    layers: list[list[int]]
    """Global 0-based layer indices of each model chunk (vp stage) of this rank."""
    modules: list[str]
    """The offload modules asked for that this stage has."""
    module_bytes_per_layer: dict[str, int]
    """Bytes one layer's calls of each module save (a MoE layer: all its local experts), those held
    elsewhere included (``group_kept_bytes``)."""
    chunk_module_bytes: dict[int, dict[str, int]]
    """vp stage -> module -> bytes one chunk's calls of it save (all its layers), whatever groups they form."""
    group_bytes: dict[int, list[int]]
    """vp stage -> bytes of each offload group of one chunk, in forward order."""
    group_kept_bytes: dict[int, list[int]]
    """vp stage -> of ``group_bytes``, the bytes each group keeps on device even when copied: held
    elsewhere (`model.held_elsewhere`; as the engine's `IterationRecord.group_kept_bytes` once it
    learned them, NOTE [Storages held elsewhere]); the same for every microbatch."""
    group_names: dict[int, list[str]]
    """vp stage -> name of each offload group of one chunk, parallel to ``group_bytes`` ('+' joins names)."""
    chunks_in_flight_peak: int
    """Most chunks whose forward ran and whose backward has not, over the plan."""
    kept_chunks: list[tuple[int, int]]
    """(microbatch, vp stage) chunks the schedule policy keeps on device."""
    simulation: Simulation = field(repr=False)
    """The replayed accounting of the offload groups (`chunk_offload.schedule.simulate`)."""
    activation_bytes_per_chunk: dict[int, int]
    """vp stage -> everything one chunk's layers save (NOTE [Stage activation peak])."""
    activation_peak_bytes: int
    """Peak of the layers' saved bytes over the plan, without offload."""
    other_activation_bytes: int
    """Bytes added to the stage's peak for what the model does not cover (given by the user)."""
    copy_seconds_per_layer: float
    """Offload copy time of the stage's worst layer (highest copy / compute)."""
    compute_seconds_per_layer: float
    """Forward compute time of that layer (the offload copies run under it)."""
    backward_compute_seconds_per_layer: float
    """Backward compute time of that layer (the reloads run under it; flash-style attention
    counted with its recompute)."""
    reload_seconds_per_layer: float = 0.0
    """Reload copy time of that layer (`Hardware.reload_seconds`: the host-to-device rate)."""
    worst_layer: int | None
    """Global index of that layer (None when the stage has no layer offloading anything)."""

    @property
    def peak_saved_bytes(self) -> int:
        """Peak of the offload modules' saved bytes without offload."""
        return self.simulation.peak_saved_bytes

    @property
    def peak_resident_bytes(self) -> int:
        """Peak of the offload modules' device-resident saved bytes with offload."""
        return self.simulation.peak_resident_bytes

    @property
    def drop(self) -> int:
        """Predicted fall of the stage's peak."""
        return self.simulation.drop

    @property
    def bytes_offloaded(self) -> int:
        """Bytes copied to host per iteration."""
        return self.simulation.bytes_offloaded

    @property
    def hides(self) -> bool:
        """Whether the worst layer's offload copies take no longer than its forward compute and its
        reloads no longer than its backward compute."""
        return (
            self.copy_seconds_per_layer <= self.compute_seconds_per_layer
            and self.reload_seconds_per_layer <= self.backward_compute_seconds_per_layer
        )

    @property
    def peak_with_offload_bytes(self) -> int:
        """Estimated stage activation peak with offload, plus ``other_activation_bytes``."""
        return self.activation_peak_bytes - self.drop + self.other_activation_bytes

    @property
    def peak_without_offload_bytes(self) -> int:
        """Estimated stage activation peak without offload, plus ``other_activation_bytes``."""
        return self.activation_peak_bytes + self.other_activation_bytes

    def to_dict(self) -> dict:
        """Plain JSON-able values."""
        return {
            "pp_rank": self.pp_rank,
            "layers": self.layers,
            "modules": self.modules,
            "module_bytes_per_layer": self.module_bytes_per_layer,
            "chunk_module_bytes": {str(vp): b for vp, b in self.chunk_module_bytes.items()},
            "group_bytes": {str(vp): b for vp, b in self.group_bytes.items()},
            "group_kept_bytes": {str(vp): b for vp, b in self.group_kept_bytes.items()},
            "group_names": {str(vp): n for vp, n in self.group_names.items()},
            "chunks_in_flight_peak": self.chunks_in_flight_peak,
            "kept_chunks": [list(c) for c in self.kept_chunks],
            "peak_saved_bytes": self.peak_saved_bytes,
            "peak_resident_bytes": self.peak_resident_bytes,
            "drop": self.drop,
            "host_bytes_at_saved_peak": self.simulation.host_bytes_at_saved_peak,
            "bytes_offloaded": self.bytes_offloaded,
            "activation_bytes_per_chunk": {str(vp): b for vp, b in self.activation_bytes_per_chunk.items()},
            "activation_peak_bytes": self.activation_peak_bytes,
            "other_activation_bytes": self.other_activation_bytes,
            "peak_without_offload_bytes": self.peak_without_offload_bytes,
            "peak_with_offload_bytes": self.peak_with_offload_bytes,
            "copy_seconds_per_layer": self.copy_seconds_per_layer,
            "compute_seconds_per_layer": self.compute_seconds_per_layer,
            "backward_compute_seconds_per_layer": self.backward_compute_seconds_per_layer,
            "reload_seconds_per_layer": self.reload_seconds_per_layer,
            "worst_layer": self.worst_layer,
            "hides": self.hides,
        }


def stage_layers(dims: GPTDims, pipeline: PipelineConfig, pp_rank: int) -> list[list[int]]:
    """Global layer indices of each model chunk of ``pp_rank`` (Megatron's even split), the MTP layers
    (``dims.mtp_num_layers``, indices from ``num_layers`` on) at the end of the last stage's last chunk."""
    p, vp = pipeline.pipeline_parallel, pipeline.vp_size
    if dims.num_layers % (p * vp):
        raise ChunkOffloadError(
            f"num_layers {dims.num_layers} must split evenly over {p} stages x {vp} model chunks "
            f"(a multiple of {p * vp})"
        )
    if not 0 <= pp_rank < p:
        raise ChunkOffloadError(f"pp_rank {pp_rank} out of range for {p} stages")
    per_chunk = dims.num_layers // (p * vp)
    per_vp = dims.num_layers // vp
    layers = [[v * per_vp + pp_rank * per_chunk + i for i in range(per_chunk)] for v in range(vp)]
    if pp_rank == p - 1:  # the MTP layers run after the decoder's, on the last stage's last chunk
        layers[-1] += list(range(dims.num_layers, dims.total_layers))
    return layers


def estimate_stages(
    dims: GPTDims,
    pipeline: PipelineConfig,
    modules: str | Sequence[str],
    *,
    hardware: Hardware | None = None,
    min_offload_bytes: int = _MIN_OFFLOAD_BYTES,
    schedule: Literal["plan", "group-start"] = "plan",
    other_activation_bytes: int = 0,
    policy: Literal["plan", "all"] | None = None,
    group_by: Literal["call", "module", "layer"] = config_default("OffloadConfig.group_by"),
) -> list[StageEstimate]:
    """One `StageEstimate` per pipeline rank for offloading ``modules``.

    ``schedule`` (the launcher's ``--chunk-offload-schedule``): ``"plan"`` uses `PlanPolicy` in its
    steady state, the groups known (chunks whose backward follows their forward at once copy all but
    their last group, NOTE [Kept tail]; the next backward chunk is prefetched), ``"group-start"`` the
    engine's default `SchedulePolicy` (offload every chunk). ``min_offload_bytes`` and ``group_by`` as
    in `OffloadConfig`. ``policy``: deprecated spelling of ``schedule`` (``"all"`` is ``"group-start"``).
    """
    planner = StagePlanner(
        dims,
        pipeline,
        hardware=hardware,
        min_offload_bytes=min_offload_bytes,
        schedule=schedule,
        other_activation_bytes=other_activation_bytes,
        policy=policy,
        group_by=group_by,
    )
    return planner.estimate(modules)


def _schedule(schedule: object, policy: object) -> str:
    """``schedule`` checked, or the deprecated ``policy`` translated (with a warning)."""
    if policy is not None:
        warnings.warn(
            f"chunk_offload: policy={policy!r} is deprecated and will be removed in the next release; pass "
            f"schedule={'group-start' if policy == 'all' else policy!r} (the launcher's --chunk-offload-schedule values)",
            DeprecationWarning,
            stacklevel=3,
        )
        if policy not in POLICY_SCHEDULES:
            raise ChunkOffloadError(f"policy={policy!r} is not valid; choose one of {tuple(POLICY_SCHEDULES)}")
        schedule = POLICY_SCHEDULES[policy]
    return check_value(option("ScheduleOptions.schedule_policy"), schedule, name="schedule")


class StagePlanner:
    """Estimates every stage of one model and schedule for any module set.

    What does not depend on the module set (each rank's layers, plan and activation peak) is
    computed once, so that `chunk_offload.planner.recommend` can try many sets cheaply.
    """

    def __init__(
        self,
        dims: GPTDims,
        pipeline: PipelineConfig,
        *,
        hardware: Hardware | None = None,
        min_offload_bytes: int = _MIN_OFFLOAD_BYTES,
        schedule: Literal["plan", "group-start"] = "plan",
        other_activation_bytes: int = 0,
        policy: Literal["plan", "all"] | None = None,
        group_by: Literal["call", "module", "layer"] = config_default("OffloadConfig.group_by"),
        layer_group_bytes: int | None = config_default("OffloadConfig.layer_group_bytes"),
    ) -> None:
        OffloadConfig(min_offload_bytes=min_offload_bytes, group_by=group_by, layer_group_bytes=layer_group_bytes).validate()
        schedule = _schedule(schedule, policy)
        if not isinstance(other_activation_bytes, int) or other_activation_bytes < 0:
            raise ChunkOffloadError(f"other_activation_bytes must be an int >= 0, got {other_activation_bytes!r}")
        self.dims = dims
        self.pipeline = pipeline
        self.hardware = hardware if hardware is not None else Hardware()
        self.min_offload_bytes = min_offload_bytes
        self.group_by, self.layer_group_bytes = group_by, layer_group_bytes  # `OffloadConfig`'s: the engine's groups it models (`as_groups`)
        self.schedule = schedule
        """``"plan"`` or ``"group-start"``: the schedule policy the estimate assumes."""
        self.other_activation_bytes = other_activation_bytes
        self.layers = [stage_layers(dims, pipeline, r) for r in range(pipeline.pipeline_parallel)]
        self.plans = [pipeline.plan(r) for r in range(pipeline.pipeline_parallel)]
        self.activation = [
            {v: [layer_saved_bytes(dims, layer) for layer in chunk] for v, chunk in enumerate(layers)} for layers in self.layers
        ]
        self.activation_peaks = [simulate(plan, act, offload=False).peak_saved_bytes for plan, act in zip(self.plans, self.activation)]

    def estimate(self, modules: str | Sequence[str]) -> list[StageEstimate]:
        """One `StageEstimate` per pipeline rank (an empty ``modules`` list: nothing offloaded)."""
        modules = canonical_modules(modules) if len(modules) else []
        check_modelled(modules)
        return [self._stage(r, modules) for r in range(self.pipeline.pipeline_parallel)]

    def as_groups(self, layer_groups: list[LayerGroup]) -> list[LayerGroup]:
        """One layer's module groups (`layer_offload_groups`) as the engine opens them under this planner's
        ``group_by``: as they are ("call"), with joined calls ("module", `joined_groups`), or ("layer",
        `merged_layer_group`) in one group or, under ``layer_group_bytes``, a group per run of calls."""
        if self.group_by == "layer":
            return merged_layer_group(self.dims, layer_groups, self.layer_group_bytes)
        return joined_groups(self.dims, layer_groups) if self.group_by == "module" else layer_groups

    def _layer_groups(self, pp_rank: int, vp: int, modules: list[str]) -> list[tuple[int, list[LayerGroup]]]:
        """(layer, its groups) for each layer of chunk ``vp`` of ``pp_rank``. The chunk's first layer
        receives its input unless the chunk is the model's first (`model.held_elsewhere`)."""
        first_chunk = (pp_rank, vp) == (0, 0)  # its input comes from the embedding
        out = []
        for i, layer in enumerate(self.layers[pp_rank][vp]):
            receives = i == 0 and not first_chunk
            out.append((layer, layer_offload_groups(self.dims, layer, modules, min_offload_bytes=self.min_offload_bytes, receives_input=receives)))
        return out

    def _stage(self, pp_rank: int, modules: list[str]) -> StageEstimate:
        dims, hardware, layers, plan = self.dims, self.hardware, self.layers[pp_rank], self.plans[pp_rank]
        per_layer = {v: self._layer_groups(pp_rank, v, modules) for v in range(len(layers))}
        groups = {v: [g for _, lg in chunk for g in self.as_groups(lg)] for v, chunk in per_layer.items()}
        group_bytes = {v: [g.nbytes for g in gs] for v, gs in groups.items()}
        kept_bytes = {v: [g.kept_bytes for g in gs] for v, gs in groups.items()}
        module_bytes_per_layer: dict[str, int] = {}
        worst, copy_s, compute_s, reload_s = None, 0.0, 0.0, 0.0
        for layer, layer_groups_ in (entry for chunk in per_layer.values() for entry in chunk):
            module_bytes_per_layer.update(_per_name(layer_groups_))
            offloaded = sum(g.nbytes - g.kept_bytes for g in self.as_groups(layer_groups_))  # what its copies move
            c, f = hardware.copy_seconds(offloaded), hardware.compute_seconds(layer_forward_flops(dims, layer))
            if offloaded and (worst is None or c / f > copy_s / compute_s):
                worst, copy_s, compute_s, reload_s = layer, c, f, hardware.reload_seconds(offloaded)
        if worst is None:  # nothing offloaded: report the first layer's compute
            compute_s = hardware.compute_seconds(layer_forward_flops(dims, layers[0][0]))
        policy = PlanPolicy(plan, group_bytes=group_bytes) if self.schedule == "plan" else None
        simulation = simulate(plan, group_bytes, policy=policy, kept_bytes=kept_bytes)
        return StageEstimate(
            pp_rank=pp_rank,
            layers=layers,
            modules=[m for m in modules if m in module_bytes_per_layer],
            module_bytes_per_layer=module_bytes_per_layer,
            chunk_module_bytes={v: _per_name([g for _, lg in chunk for g in lg]) for v, chunk in per_layer.items()},
            group_bytes=group_bytes,
            group_kept_bytes=kept_bytes,
            group_names={v: [g.name for g in gs] for v, gs in groups.items()},
            chunks_in_flight_peak=max(plan.in_flight(), default=0),
            kept_chunks=list(simulation.kept),
            simulation=simulation,
            activation_bytes_per_chunk={v: sum(b) for v, b in self.activation[pp_rank].items()},
            activation_peak_bytes=self.activation_peaks[pp_rank],
            other_activation_bytes=self.other_activation_bytes,
            copy_seconds_per_layer=copy_s,
            compute_seconds_per_layer=compute_s,
            backward_compute_seconds_per_layer=hardware.compute_seconds(
                layer_backward_flops(dims, worst if worst is not None else layers[0][0])
            ),
            reload_seconds_per_layer=reload_s,
            worst_layer=worst,
        )


def _per_name(groups: list[LayerGroup]) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in groups:
        out[g.name] = out.get(g.name, 0) + g.nbytes
    return out
