"""Per-stage estimate: bytes per module, chunks in flight, predicted drop, copy against compute.

For each pipeline rank, `estimate_stages`:

1. places the layers: chunk v of stage r holds the global layers from
   ``v * L / vp + r * L / (pp * vp)`` on, ``L / (pp * vp)`` of them (Megatron's even split);
2. lists the offload groups of one chunk in forward order with their bytes (`model.layer_groups`);
3. takes the rank's plan from Megatron's own schedule tables (`megatron_plan`) and replays the
   engine's accounting over it (`chunk_offload.schedule.simulate`): the peak of the offload
   modules' saved bytes without offload, with offload, the drop, the bytes copied;
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

from dataclasses import dataclass, field
from typing import Literal, Sequence

from ..core.errors import ChunkOffloadError
from ..schedule import Plan, PlanPolicy, Simulation, megatron_plan, simulate
from ..module_names import canonical_modules
from .dims import GPTDims
from .model import layer_backward_flops, layer_forward_flops, layer_groups, layer_saved_bytes

__all__ = ["GB", "Hardware", "PipelineConfig", "StageEstimate", "StagePlanner", "estimate_stages", "stage_layers"]

GB = 1e9
"""Bytes per GB (decimal, as link bandwidths are quoted)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class PipelineConfig:
    """The pipeline schedule: Megatron's 1F1B (``virtual_pipeline`` None) or interleaved 1F1B."""

    pipeline_parallel: int = 1
    """Pipeline stages p."""
    virtual_pipeline: int | None = None
    """Model chunks per stage for the interleaved schedule; None (or 1) for plain 1F1B."""
    num_microbatches: int = 1
    """Microbatches per iteration m."""
    microbatch_group_size_per_vp_stage: int | None = None
    """Megatron's option of the same name (interleaved only); None for its default, p."""

    def __post_init__(self) -> None:
        p, vp, m = self.pipeline_parallel, self.virtual_pipeline, self.num_microbatches
        for label, value in (("pipeline_parallel", p), ("num_microbatches", m)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ChunkOffloadError(f"{label} must be an int >= 1, got {value!r}")
        if vp is None or vp == 1:
            return
        if not isinstance(vp, int) or vp < 1:
            raise ChunkOffloadError(f"virtual_pipeline must be None or an int >= 1, got {vp!r}")
        if p < 2:
            raise ChunkOffloadError(f"virtual_pipeline={vp} needs pipeline_parallel >= 2, got {p}")
        group = self.microbatch_group_size_per_vp_stage if self.microbatch_group_size_per_vp_stage is not None else p
        # The checks of megatron-core's forward_backward_pipelining_with_interleaving.
        if not p <= group <= m:
            raise ChunkOffloadError(
                f"the interleaved schedule needs pipeline_parallel ({p}) <= microbatch group size ({group}) <= "
                f"num_microbatches ({m}); use at least {group} microbatches"
            )
        if 0 < m % group < p:
            raise ChunkOffloadError(
                f"the interleaved schedule needs num_microbatches ({m}) to be a multiple of the microbatch group "
                f"size ({group}) or leave a remainder >= pipeline_parallel ({p}); e.g. use {m - m % group or group} or {m - m % group + group}"
            )

    @property
    def vp_size(self) -> int:
        return self.virtual_pipeline or 1

    @property
    def interleaved(self) -> bool:
        return self.vp_size > 1

    def plan(self, pp_rank: int) -> Plan:
        """The actions megatron-core's schedule runs on ``pp_rank``."""
        return megatron_plan(
            pp_size=self.pipeline_parallel,
            pp_rank=pp_rank,
            num_microbatches=self.num_microbatches,
            vp_size=self.virtual_pipeline if self.interleaved else None,
            microbatch_group_size_per_vp_stage=self.microbatch_group_size_per_vp_stage,
        )


@dataclass(kw_only=True, frozen=True, slots=True)
class Hardware:
    """The device and its host link, for copy time against compute time."""

    host_bandwidth_gbs: float = 25.0
    """Device-to-host copy bandwidth per direction in GB/s (1e9 bytes): about 25 for PCIe 4 x16
    as achieved with pinned memory, about 50 for PCIe 5 x16."""
    device_tflops: float = 400.0
    """Sustained dense matmul throughput in TFLOP/s. The default 400 is about 40% of an H100
    SXM's 989 dense BF16 peak, a typical achieved model-FLOP utilisation; pass your own."""

    def __post_init__(self) -> None:
        for label in ("host_bandwidth_gbs", "device_tflops"):
            value = getattr(self, label)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ChunkOffloadError(f"{label} must be a number > 0, got {value!r}")

    def copy_seconds(self, nbytes: int) -> float:
        return nbytes / (self.host_bandwidth_gbs * GB)

    def compute_seconds(self, flops: int) -> float:
        return flops / (self.device_tflops * 1e12)


@dataclass(kw_only=True)
class StageEstimate:
    """The prediction for one pipeline stage on one tensor-parallel rank (byte counts are per microbatch unless named otherwise)."""

    pp_rank: int
    layers: list[list[int]]
    """Global 0-based layer indices of each model chunk (vp stage) of this rank."""
    modules: list[str]
    """The offload modules asked for that this stage has."""
    module_bytes_per_layer: dict[str, int]
    """Bytes one layer's calls of each module offload (a MoE layer: all its local experts)."""
    chunk_module_bytes: dict[int, dict[str, int]]
    """vp stage -> module -> bytes offloaded by one chunk (all its layers)."""
    group_bytes: dict[int, list[int]]
    """vp stage -> bytes of each offload group of one chunk, in forward order."""
    group_names: dict[int, list[str]]
    """vp stage -> module name of each offload group of one chunk (parallel to ``group_bytes``)."""
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
        """Whether every layer's copies take no longer than its forward compute."""
        return self.copy_seconds_per_layer <= self.compute_seconds_per_layer

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
            "worst_layer": self.worst_layer,
            "hides": self.hides,
        }


def stage_layers(dims: GPTDims, pipeline: PipelineConfig, pp_rank: int) -> list[list[int]]:
    """Global layer indices of each model chunk of ``pp_rank`` (Megatron's even split)."""
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
    return [[v * per_vp + pp_rank * per_chunk + i for i in range(per_chunk)] for v in range(vp)]


def estimate_stages(
    dims: GPTDims,
    pipeline: PipelineConfig,
    modules: str | Sequence[str],
    *,
    hardware: Hardware | None = None,
    min_offload_bytes: int = 1 << 20,
    policy: Literal["plan", "all"] = "plan",
    other_activation_bytes: int = 0,
) -> list[StageEstimate]:
    """One `StageEstimate` per pipeline rank for offloading ``modules``.

    ``policy``: ``"plan"`` uses `PlanPolicy` in its steady state, the groups known (chunks whose
    backward follows their forward at once copy all but their last group, NOTE [Kept tail]; the
    next backward chunk is prefetched), ``"all"`` the engine's default
    `SchedulePolicy` (offload every chunk). ``min_offload_bytes`` as in `OffloadConfig`.
    """
    planner = StagePlanner(
        dims,
        pipeline,
        hardware=hardware,
        min_offload_bytes=min_offload_bytes,
        policy=policy,
        other_activation_bytes=other_activation_bytes,
    )
    return planner.estimate(modules)


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
        min_offload_bytes: int = 1 << 20,
        policy: Literal["plan", "all"] = "plan",
        other_activation_bytes: int = 0,
    ) -> None:
        if not isinstance(min_offload_bytes, int) or min_offload_bytes < 0:
            raise ChunkOffloadError(f"min_offload_bytes must be an int >= 0, got {min_offload_bytes!r}")
        if policy not in ("plan", "all"):
            raise ChunkOffloadError(f"unknown policy {policy!r}; valid: ['all', 'plan']")
        if not isinstance(other_activation_bytes, int) or other_activation_bytes < 0:
            raise ChunkOffloadError(f"other_activation_bytes must be an int >= 0, got {other_activation_bytes!r}")
        self.dims = dims
        self.pipeline = pipeline
        self.hardware = hardware if hardware is not None else Hardware()
        self.min_offload_bytes = min_offload_bytes
        self.policy = policy
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
        return [self._stage(r, modules) for r in range(self.pipeline.pipeline_parallel)]

    def _groups(self, layer: int, modules: list[str]) -> list[tuple[str, int]]:
        return layer_groups(self.dims, layer, modules, min_offload_bytes=self.min_offload_bytes)

    def _stage(self, pp_rank: int, modules: list[str]) -> StageEstimate:
        dims, hardware, layers, plan = self.dims, self.hardware, self.layers[pp_rank], self.plans[pp_rank]
        groups = {v: [g for layer in chunk for g in self._groups(layer, modules)] for v, chunk in enumerate(layers)}
        group_bytes = {v: [b for _, b in g] for v, g in groups.items()}
        module_bytes_per_layer: dict[str, int] = {}
        worst, copy_s, compute_s = None, 0.0, 0.0
        for layer in (i for chunk in layers for i in chunk):
            layer_groups_ = self._groups(layer, modules)
            module_bytes_per_layer.update(_per_name(layer_groups_))
            offloaded = sum(b for _, b in layer_groups_)
            c, f = hardware.copy_seconds(offloaded), hardware.compute_seconds(layer_forward_flops(dims, layer))
            if offloaded and (worst is None or c / f > copy_s / compute_s):
                worst, copy_s, compute_s = layer, c, f
        if worst is None:  # nothing offloaded: report the first layer's compute
            compute_s = hardware.compute_seconds(layer_forward_flops(dims, layers[0][0]))
        policy = PlanPolicy(plan, group_bytes=group_bytes) if self.policy == "plan" else None
        simulation = simulate(plan, group_bytes, policy=policy)
        return StageEstimate(
            pp_rank=pp_rank,
            layers=layers,
            modules=[m for m in modules if m in module_bytes_per_layer],
            module_bytes_per_layer=module_bytes_per_layer,
            chunk_module_bytes={v: _per_name(g) for v, g in groups.items()},
            group_bytes=group_bytes,
            group_names={v: [name for name, _ in g] for v, g in groups.items()},
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
            worst_layer=worst,
        )


def _per_name(groups: list[tuple[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, nbytes in groups:
        out[name] = out.get(name, 0) + nbytes
    return out
