"""Picklable hooks that attach an offload manager inside the harness's ranks (see ``_gpt.Hooks``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class OffloadHooks:
    """``wrap_model`` attaches a manager; ``wrap_forward_backward`` wraps Megatron's schedule with it."""

    modules: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=lambda: {"min_offload_bytes": 1})
    evaluate_between: bool = False
    manager: Any = None

    def wrap_model(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        from chunk_offload.integrations.megatron import attach

        self.manager = attach(chunks, list(self.modules), **self.options)
        return chunks

    def wrap_forward_backward(self, forward_backward):
        wrapped = self.manager.wrap(forward_backward)
        if not self.evaluate_between:
            return wrapped

        def train_then_evaluate(**kwargs):
            out = wrapped(**kwargs)
            with torch.no_grad():
                wrapped(**{**kwargs, "forward_only": True})
            return out

        return train_then_evaluate

    def report(self, chunks: list[torch.nn.Module]) -> dict[str, Any]:
        stats = self.manager.stats()
        self.manager.close()
        return {
            "registered": dict(self.manager.registered),
            "offloaded": {n: g.bytes_offloaded for n, g in stats.groups.items()},
            "reloaded": {n: g.bytes_reloaded for n, g in stats.groups.items()},
            "groups": {n: g.groups for n, g in stats.groups.items()},
            "pool_in_use": stats.pool.in_use_bytes,
            "resident": stats.resident_bytes,
            "host": stats.host_bytes,
            "live_chunks": self.manager.live_chunks(),
            "observed_order": list(self.manager.observed_order),
        }
