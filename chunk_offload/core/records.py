"""Records: what one iteration did (`IterationRecord`), kept per iteration by the manager.

Stats (`stats.py`) are totals over the run; a record is one iteration's snapshot, which the
schedule, the budgets and the report read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .actions import Action
from .stats import GroupStats

__all__ = ["IterationRecord"]


@dataclass
class IterationRecord:
    """What one `OffloadManager.iteration` did: its peaks, traces and bytes per group.

    The accounting fields count the saved bytes of offload groups (storage spans, deduplicated),
    over this iteration only. ``device_peak_bytes`` is the device's own measure where it has one
    (CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` at the start of
    the iteration), None on CPU.
    """

    offload: bool
    """Whether copies were made (False: a baseline iteration with identical accounting)."""
    peak_resident_bytes: int
    """High-water mark of device-resident saved bytes in this iteration."""
    peak_saved_bytes: int
    """High-water mark of saved bytes wherever they live: the peak this iteration would have without offload."""
    host_bytes_at_saved_peak: int
    """Bytes on host only at the moment of ``peak_saved_bytes``."""
    device_peak_bytes: int | None
    """CUDA: peak allocated device memory of the iteration; None on CPU."""
    resident_trace: list[int] | None
    """Device-resident saved bytes after each accounting change (``OffloadConfig.trace``), else None."""
    device_trace: list[int] | None
    """CUDA with ``trace``: ``torch.cuda.memory_allocated()`` at the same moments, else None."""
    group_bytes: dict[tuple[int, int], list[int]]
    """(microbatch, vp_stage) -> saved bytes of each of the chunk's groups, in forward order."""
    groups: dict[str, GroupStats]
    """Counters of this iteration per group name (bytes, copy and wait seconds)."""
    order: list[Action]
    """The F and B `Action`s as the engine saw the chunks start forward and backward (backward:
    when it first reached one of the chunk's groups)."""
    wall_time_s: float
    """Host wall time of the iteration (on CUDA with ``measure_time`` the device is synchronised at both ends)."""
    group_names: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    """(microbatch, vp_stage) -> the name of each of the chunk's groups, in forward order
    (parallel to ``group_bytes``)."""
    group_kept_bytes: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    """(microbatch, vp_stage) -> of ``group_bytes``, the bytes each group keeps on device even
    when it is offloaded (storages another saved view or reference holds: NOTE [Storages held
    elsewhere]); parallel to ``group_bytes``."""
    group_learned_bytes: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    """(microbatch, vp_stage) -> of ``group_bytes``, the bytes each group was found, at the
    chunk's forward end, to save in storages another reference holds (copied for nothing, or
    probed in a baseline): later chunks keep them on device (NOTE [Storages held elsewhere])."""
    group_shared: dict[tuple[int, int], list[tuple[int, ...]]] = field(default_factory=dict)
    """(microbatch, vp_stage) -> the sets of the chunk's groups that saved one storage held
    nowhere else: a copy of some of a set frees nothing. Looked for in the chunks that copied or
    were probed (NOTE [Storages held elsewhere]), an empty list where there are none; chunks kept
    whole are left out (what a chunk shares does not change from one iteration to the next)."""
    action_starts_s: list[float] = field(default_factory=list)
    """For each entry of ``order``: seconds from the iteration's start at which that action
    began (host ``perf_counter``; on CUDA the host runs ahead of the device)."""

    def kept_bytes_of(self, microbatch: int, vp_stage: int) -> list[int]:
        """``group_kept_bytes`` of one chunk, zeros where none were recorded: `simulate`'s ``kept_bytes``."""
        kept = self.group_kept_bytes.get((microbatch, vp_stage))
        return list(kept) if kept is not None else [0] * len(self.group_bytes[(microbatch, vp_stage)])

    def kept_from_now_of(self, microbatch: int, vp_stage: int) -> list[int]:
        """`kept_bytes_of` plus ``group_learned_bytes``: what each group of the chunk keeps on device
        from the next iteration on, the ``kept_bytes`` a device budget chooses with."""
        learned = self.group_learned_bytes.get((microbatch, vp_stage))
        kept = self.kept_bytes_of(microbatch, vp_stage)
        return kept if learned is None else [k + n for k, n in zip(kept, learned, strict=True)]

    @property
    def peak_bytes(self) -> int:
        """The peak this report measures: device memory on CUDA, the accounting on CPU."""
        return self.device_peak_bytes if self.device_peak_bytes is not None else self.peak_resident_bytes
