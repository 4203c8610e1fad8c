"""Helpers shared by the auto-iterations tests: an iteration record without its times, and plain modules
shaped like a megatron GPTModel chunk (``decoder.layers[i].self_attention.linear_qkv``) trained as megatron's
no-pipelining schedule does.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
from torch import nn

from chunk_offload.core.records import IterationRecord
from chunk_offload.core.stats import GroupStats
from tests._driver import drive, no_pipelining


def comparable(record: IterationRecord) -> dict[str, Any]:
    """Every field of a record except times (wall time, action starts, copy and wait seconds)."""
    counts = [f.name for f in fields(GroupStats) if not f.name.endswith("_time_s")]
    out = {f.name: getattr(record, f.name) for f in fields(IterationRecord) if f.name not in ("groups", "wall_time_s", "action_starts_s")}
    out["groups"] = {name: {c: getattr(g, c) for c in counts} for name, g in record.groups.items()}
    return out


class ChunkLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.self_attention.linear_qkv(x))


class GPTLikeChunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([ChunkLayer(), ChunkLayer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.decoder.layers:
            x = layer(x)
        return x


def microbatch(i: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(i))


def train_step(chunk: nn.Module, microbatches: int, *, first: int = 0) -> list[torch.Tensor]:
    """What megatron's no-pipelining schedule does: forward and backward of each microbatch in turn, on
    microbatches ``first``, ``first + 1``, ...; the losses. The attached manager's chunk hooks delimit
    its chunks (the driver opens no scope); gradients accumulate."""
    inputs = [microbatch(i) for i in range(first, first + microbatches)]
    return drive(chunk, inputs=inputs, order=no_pipelining(microbatches), loss=torch.sum, params=[], lr=None).losses
