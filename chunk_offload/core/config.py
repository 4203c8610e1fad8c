"""`OffloadConfig`: the typed options of an `OffloadManager`, checked in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

from .errors import ChunkOffloadError

__all__ = ["ON_EXHAUSTED", "OffloadConfig"]

ON_EXHAUSTED = ("fallback", "error")
"""The accepted values of `OffloadConfig.on_exhausted`."""


@dataclass(kw_only=True, slots=True)
class OffloadConfig:
    """Options of an `OffloadManager` (and of the integrations' ``attach(..., config=...)``)."""

    min_offload_bytes: int = 1 << 20
    """Saved tensors smaller than this stay on device (copies of small tensors cost more than they save)."""
    host_pool_bytes: int | None = None
    """Cap on the host memory of the pool; ``None`` for no cap."""
    on_exhausted: Literal["fallback", "error"] = "fallback"
    """At the cap: allocate unpooled host buffers with one warning, or raise."""
    offload: bool = True
    """False: track groups and resident bytes but copy nothing (a baseline with identical accounting)."""
    measure_time: bool = True
    """Time copies and compute waits (CUDA events on GPU); `stats` reports them."""
    trace: bool = False
    """Record the resident saved bytes (and on CUDA the allocated device memory) after every
    accounting change of an iteration, in `IterationRecord.resident_trace` / ``device_trace``."""
    deterministic_memory: bool = False
    """True: compute waits on each group's copy to host before its device originals are released,
    so device memory follows the program exactly, at the cost of stalls where the link lags.
    False: the originals are handed to the copy stream and their memory is reused once their
    copy ends, with no stall (NOTE [Release by the copy stream] in core/copies.py)."""
    profile_ranges: bool = False
    """Mark each group's offload and reload issue, the compute waits on them and policy prefetches
    with `torch.profiler.record_function` ranges (NVTX ranges on CUDA under nsys or ``emit_nvtx``),
    named ``chunk_offload::<step> <group>[<index>] mb=<microbatch> vp=<vp_stage>``. Off: no range
    object is made."""

    def validate(self) -> None:
        """Raise `ChunkOffloadError` naming the first field whose value is not accepted."""
        _check_bytes("min_offload_bytes", self.min_offload_bytes, optional=False)
        _check_bytes("host_pool_bytes", self.host_pool_bytes, optional=True)
        if not isinstance(self.on_exhausted, str) or self.on_exhausted not in ON_EXHAUSTED:
            raise ChunkOffloadError(f"on_exhausted={self.on_exhausted!r} is not valid; choose one of {ON_EXHAUSTED}")
        for name in ("offload", "measure_time", "trace", "deterministic_memory", "profile_ranges"):
            if not isinstance(getattr(self, name), bool):
                raise ChunkOffloadError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        """The option names, for messages."""
        return [f.name for f in fields(cls)]


def _check_bytes(name: str, value: object, *, optional: bool) -> None:
    """A byte count is an int >= 0 (bool, float, nan and inf refused); None only where ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        accepted = "an int >= 0 or None" if optional else "an int >= 0"
        if isinstance(value, float) and not math.isfinite(value):
            accepted += " (not nan or inf)"
        raise ChunkOffloadError(f"{name} must be {accepted}, got {value!r}")
