"""Copy streams and events behind one small interface, for CUDA and for CPU.

The engine only ever talks to a `StreamBackend` (`base.py`: a compute stream and two copy
streams, events, and the happens-before checker, NOTE [Happens-before rules]).
`CudaStreams` (`cuda.py`) maps it onto `torch.cuda` streams; `CpuStreams` (`cpu.py`) runs each
copy stream on a worker thread.
"""

from __future__ import annotations

import torch

from .base import Event, Mark, Stream, StreamBackend, TimeMark, Timing, VectorClocks
from .cpu import CpuStreams
from .cuda import CudaStreams

__all__ = ["CpuStreams", "CudaStreams", "Event", "Mark", "Stream", "StreamBackend", "TimeMark", "Timing", "VectorClocks", "default_streams"]


def default_streams(device: torch.device | int | str | None = None) -> StreamBackend:
    """CUDA streams when CUDA is available (or ``device`` is a CUDA device), CPU streams otherwise."""
    if device is not None and torch.device(device).type == "cpu":
        return CpuStreams()
    if torch.cuda.is_available():
        return CudaStreams(device)
    return CpuStreams()
