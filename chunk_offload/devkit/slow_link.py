"""A chain of groups whose backward compute and reload link take real (slept) time, for the
timed reload-ahead tests (tests/schedule, tests/integrations) and ``bench/budget_reload.py``:
which reload-ahead budget, or which device-budget choice, waits less is then measured on CPU
streams, not only predicted."""

from __future__ import annotations

import time

import torch
from torch import nn

from chunk_offload import CpuStreams, OffloadManager

__all__ = ["LAYOUT", "LINK", "UNIT", "chain", "register", "slow_streams"]

UNIT = 16384  # floats: a small group saves 64 KiB, a large one 640 KiB
SECONDS_PER_UNIT = 0.01  # backward compute per unit saved
LINK = 4 * UNIT / 0.005  # bytes/s back: 5 ms per unit, twice as fast as compute
LAYOUT = (1, 10) * 4  # units saved per group, forward order: small in front of large; the last stays


class _Sleepy(torch.autograd.Function):
    """``x * w``, saving ``k`` copies of ``x``; its backward sleeps ``k`` units of compute."""

    @staticmethod
    def forward(ctx, x, w, k):
        ctx.k, ctx.w = k, w.item()  # the weight as a number: only the copies of x are saved
        ctx.save_for_backward(x.repeat(k))
        return x * w

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.k * SECONDS_PER_UNIT)
        (saved,) = ctx.saved_tensors
        x = saved[: grad.numel()]
        return grad * ctx.w, (grad * x).sum().reshape(1), None


class _Group(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.w = nn.Parameter(torch.full((1,), 1.0 + 0.01 * k))

    def forward(self, x):
        return _Sleepy.apply(x, self.w, self.k)


def chain() -> nn.Sequential:
    """The groups of `LAYOUT`, in forward order."""
    return nn.Sequential(*[_Group(k) for k in LAYOUT])


def slow_streams() -> CpuStreams:
    """CPU streams whose reload link copies `LINK` bytes per second (the offload link is fast)."""
    return CpuStreams(link_bytes_per_s=1e9, reload_link_bytes_per_s=LINK)


def register(manager: OffloadManager, model: nn.Sequential) -> None:
    """Offload each group of ``model`` under its size's name."""
    for group in model:
        manager.offload_module(group, "large" if group.k > 1 else "small")
