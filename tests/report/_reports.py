"""Hand-built stage reports for the rendering tests (no training run needed)."""

from __future__ import annotations

from chunk_offload.report import StageReport


def sample_report(rank: int, *, pp_size: int = 2, vp_size: int = 2, measure: str = "cpu_saved_bytes_accounting") -> StageReport:
    """A plausible report of ``rank``: earlier stages hold more and save more, like 1F1B."""
    unit = 4096 * (pp_size - rank % pp_size)
    without = [unit * k for k in (1, 2, 3, 2, 3, 2, 1, 0)]
    with_offload = [unit * k // 4 for k in (4, 5, 6, 5, 6, 5, 4, 0)]
    return StageReport(
        rank=rank,
        pp_rank=rank % pp_size,
        pp_size=pp_size,
        vp_size=vp_size,
        measure=measure,
        peak_without=max(without),
        peak_with=max(with_offload),
        theoretical_drop=max(without) - max(with_offload),
        predicted_peak_without=max(without),
        predicted_peak_with=max(with_offload),
        bytes_per_module={"core_attn": 3 * unit, "qkv_linear": 2 * unit},
        copy_ms=1.5 + rank,
        wait_ms=0.25 * rank,
        trace_without=without,
        trace_with=with_offload,
        baseline_iteration=0,
        offload_iteration=2,
    )
