"""Picklable harness hooks that record each training iteration's accounting (see ``tests._megatron.Hooks``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tests._megatron_offload import OffloadHooks

__all__ = ["RecordHooks"]


@dataclass
class RecordHooks(OffloadHooks):
    """`OffloadHooks` whose ``after_step`` returns the manager's record of the iteration just run.

    ``attention="sdpa"``: the harness's chunks get torch's SDPA core attention
    (`chunk_offload.devkit.attention.use_sdpa`) before the offload manager is attached.
    """

    attention: str = "local"

    def wrap_model(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        if self.attention == "sdpa":
            from chunk_offload.devkit.attention import use_sdpa

            assert use_sdpa(chunks) > 0
        return super().wrap_model(chunks)

    def after_step(self, chunks: list[torch.nn.Module], iteration: int) -> dict[str, Any]:
        record = self.manager.last_iteration
        plan = self.manager.plan
        return {
            "peak_saved_bytes": record.peak_saved_bytes,
            "peak_resident_bytes": record.peak_resident_bytes,
            "host_bytes_at_saved_peak": record.host_bytes_at_saved_peak,
            "bytes_offloaded": sum(g.bytes_offloaded for g in record.groups.values()),
            "group_bytes": {tuple(k): list(v) for k, v in record.group_bytes.items()},
            "group_kept_bytes": {tuple(k): record.kept_bytes_of(*k) for k in record.group_bytes},
            "plan": None if plan is None else [str(a) for a in plan.actions],
            "policy": self.manager.tracking.ran_policy,
        }
