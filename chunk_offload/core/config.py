"""`OffloadConfig`: the typed options of an `OffloadManager`, checked in one place.

Defaults and checks come from the option table (`option_table.OPTIONS`), which the command
lines read too: one row per field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from .option_table import OPTIONS, check_value, config_default, option

__all__ = ["ON_EXHAUSTED", "OffloadConfig"]

ON_EXHAUSTED = option("OffloadConfig.on_exhausted").choices
"""The accepted values of `OffloadConfig.on_exhausted`."""


@dataclass(kw_only=True, slots=True)
class OffloadConfig:
    """Options of an `OffloadManager` (and of the integrations' ``attach(..., config=...)``)."""

    min_offload_bytes: int = config_default("OffloadConfig.min_offload_bytes")
    """Saved tensors smaller than this stay on device (copies of small tensors cost more than they save)."""
    host_pool_bytes: int | None = config_default("OffloadConfig.host_pool_bytes")
    """Cap on the host memory of the pool; ``None`` for no cap."""
    on_exhausted: Literal["fallback", "error"] = config_default("OffloadConfig.on_exhausted")
    """At the cap: allocate unpooled host buffers with one warning, or raise."""
    offload: bool = not config_default("OffloadConfig.offload")  # the table's row is --chunk-offload-baseline
    """False: track groups and resident bytes but copy nothing (a baseline with identical accounting)."""
    measure_time: bool = config_default("OffloadConfig.measure_time")
    """Time copies and compute waits (CUDA events on GPU); `stats` reports them."""
    trace: bool = config_default("OffloadConfig.trace")
    """Record the resident saved bytes (and on CUDA the allocated device memory) after every
    accounting change of an iteration, in `IterationRecord.resident_trace` / ``device_trace``."""
    deterministic_memory: bool = config_default("OffloadConfig.deterministic_memory")
    """True: compute waits on each group's copy to host before its device originals are released,
    so device memory follows the program exactly, at the cost of stalls where the link lags.
    False: the originals are handed to the copy stream and their memory is reused once their
    copy ends, with no stall (NOTE [Release by the copy stream] in core/copies.py)."""
    group_by: Literal["call", "module", "layer"] = config_default("OffloadConfig.group_by")
    """'layer' (the default): calls of modules registered with one ``layer`` (`OffloadManager.offload_module`)
    that follow one another in a chunk's forward form one group while it holds fewer than
    ``layer_group_bytes`` (NOTE [Layer groups], [Bounded layer groups] in core/marks.py); each call of a
    module registered without a layer is a group of its own. 'module': each call of a registered
    module is one group, but a call registered to join another (``joins``) that saves a storage of
    that call's group collects into it (NOTE [Joined calls]). 'call': each call its own group, no joins."""
    layer_group_bytes: int | None = config_default("OffloadConfig.layer_group_bytes")
    """With ``group_by="layer"`` (read under it only): a call joins its layer's pending group only
    while that group holds fewer bytes to copy than this (`joins_layer_group`; NOTE [Bounded layer
    groups] in core/marks.py). None: every call of the layer joins."""
    group_slab_bytes: int = config_default("OffloadConfig.group_slab_bytes")
    """A committed group of two or more storages whose spans fit in this many bytes takes one host
    buffer and reloads with one copy into one device buffer (NOTE [Group slabs] in core/slab.py);
    0: one buffer and one copy per storage."""
    profile_ranges: bool = config_default("OffloadConfig.profile_ranges")
    """Mark each group's offload and reload issue, the compute waits on them and policy prefetches
    with `torch.profiler.record_function` ranges (NVTX ranges on CUDA under nsys or ``emit_nvtx``),
    named ``chunk_offload::<step> <group>[<index>] mb=<microbatch> vp=<vp_stage>``. Off: no range
    object is made."""

    def validate(self) -> None:
        """Raise `ChunkOffloadError` naming the first field whose value is not accepted (the
        field's row of the option table says what is)."""
        for row in _ROWS:
            check_value(row, getattr(self, row.field_name))

    @classmethod
    def field_names(cls) -> list[str]:
        """The option names, for messages."""
        return [f.name for f in fields(cls)]


_ROWS = tuple(row for row in OPTIONS if row.owner == "OffloadConfig")
