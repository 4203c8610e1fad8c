"""The pipeline schedule and the hardware a `chunk_offload.planner.StagePlanner` estimates for."""

from __future__ import annotations

import math

from dataclasses import dataclass

from ..core.errors import ChunkOffloadError
from ..schedule import Plan, megatron_plan

__all__ = ["GB", "Hardware", "PipelineConfig"]

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
    """The device and its host link, for copy time against compute time.

    The link may differ by direction (GH200-class hosts): ``d2h_gbps`` rates the offload copies,
    which run under the forward, ``h2d_gbps`` the reloads, which run under the backward; each
    defaults to ``host_bandwidth_gbs``.
    """

    host_bandwidth_gbs: float = 25.0
    """Device-host copy bandwidth per direction in GB/s (1e9 bytes): about 25 for PCIe 4 x16
    as achieved with pinned memory, about 50 for PCIe 5 x16."""
    device_tflops: float = 400.0
    """Sustained dense matmul throughput in TFLOP/s. The default 400 is about 40% of an H100
    SXM's 989 dense BF16 peak, a typical achieved model-FLOP utilisation; pass your own."""
    d2h_gbps: float | None = None
    """Device-to-host (offload) GB/s; None: ``host_bandwidth_gbs``."""
    h2d_gbps: float | None = None
    """Host-to-device (reload) GB/s; None: ``host_bandwidth_gbs``."""

    def __post_init__(self) -> None:
        for label in ("host_bandwidth_gbs", "device_tflops", "d2h_gbps", "h2d_gbps"):
            value = getattr(self, label)
            if value is None and label.endswith("gbps"):
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not value > 0:
                raise ChunkOffloadError(f"{label} must be a finite number > 0, got {value!r}")

    @property
    def offload_gbps(self) -> float:
        """The device-to-host rate in use."""
        return self.d2h_gbps if self.d2h_gbps is not None else self.host_bandwidth_gbs

    @property
    def reload_gbps(self) -> float:
        """The host-to-device rate in use."""
        return self.h2d_gbps if self.h2d_gbps is not None else self.host_bandwidth_gbs

    def copy_seconds(self, nbytes: int) -> float:
        """Seconds to offload ``nbytes`` (device to host)."""
        return nbytes / (self.offload_gbps * GB)

    def reload_seconds(self, nbytes: int) -> float:
        """Seconds to reload ``nbytes`` (host to device)."""
        return nbytes / (self.reload_gbps * GB)

    def compute_seconds(self, flops: int) -> float:
        return flops / (self.device_tflops * 1e12)
