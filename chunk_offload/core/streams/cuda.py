"""`CudaStreams`: the stream interface on `torch.cuda` streams and events."""

from __future__ import annotations

import torch

from .base import Event, Mark, Stream, StreamBackend, Timing, VectorClocks

__all__ = ["CudaStreams"]


# ----------------------------------------------------------------------------- CUDA


class _CudaEvent(Event):
    def __init__(self, clocks, mark, event: torch.cuda.Event) -> None:
        super().__init__(clocks, mark)
        self.cuda_event = event

    def synchronize(self) -> None:
        self.cuda_event.synchronize()

    def query(self) -> bool:
        return self.cuda_event.query()


class _CudaStream(Stream):
    """A CUDA stream; ``stream=None`` means whatever stream is current when used (compute)."""

    def __init__(self, name: str, clocks: VectorClocks, stream: torch.cuda.Stream | None) -> None:
        super().__init__(name, clocks)
        self._stream = stream

    def _raw(self) -> torch.cuda.Stream:
        return self._stream if self._stream is not None else torch.cuda.current_stream()

    def launch(self, fn, *, timed=False, nbytes=0):
        raw = self._raw()
        mark = self._vc.tick(self.id)
        start = end = None
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(raw)
        with torch.cuda.stream(raw):
            fn()
        if timed:
            end.record(raw)
            return mark, Timing(start=start, end=end)
        return mark, None

    def record_event(self) -> Event:
        event = torch.cuda.Event()
        event.record(self._raw())
        clocks = self._vc.snapshot(self.id)
        mark = Mark(self.id, clocks[self.id]) if clocks is not None else None
        return _CudaEvent(clocks, mark, event)

    def wait_event(self, event, *, timed=False):
        raw = self._raw()
        start = end = None
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(raw)
        raw.wait_event(event.cuda_event)
        self._vc.merge(self.id, event.clocks)
        if timed:
            # Elapsed time between two events around the wait is the time the stream stalled.
            end.record(raw)
            return Timing(start=start, end=end)
        return None


class CudaStreams(StreamBackend):
    """Compute is the current CUDA stream at each call; two dedicated copy streams."""

    def __init__(self, device: torch.device | int | str | None = None, *, check_order: bool = False) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self.pin_memory = True
        self._clocks = VectorClocks(check_order)
        self.compute = _CudaStream("compute", self._clocks, None)
        self.d2h = _CudaStream("d2h", self._clocks, torch.cuda.Stream(self.device))
        self.h2d = _CudaStream("h2d", self._clocks, torch.cuda.Stream(self.device))


