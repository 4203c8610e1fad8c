"""`InlineStreams`: copy "streams" that run each copy at once, in order, on the calling thread.

`bench/overhead.py`'s ``offload_inline`` mode offloads through them (and every offload mode of
`bench/overhead_instructions.py`): every copy is issued where
the engine launches it, on the compute stream (CUDA) or the host thread (CPU), and every event is
done when recorded, so waits issue nothing. What the mode costs over bookkeeping is then the
engine's own offload work and the copies' calls, without the copy streams' machinery (CPU: the
worker threads and their hand-offs; CUDA: stream switches, events and stream waits): the part of
the offload path that the streams do not explain (issue 22 item 5). Correct, not fast: copies on
the one compute order need no waits, and nothing overlaps them with compute. Built on core's
public stream interface only, as any user's backend would be.
"""

from __future__ import annotations

from typing import Callable

import torch

from chunk_offload.core import Event, Stream, StreamBackend, VectorClocks

__all__ = ["InlineStreams"]


class _Done(Event):
    """An event of work that ran when it was issued."""

    __slots__ = ()

    def synchronize(self) -> None:
        self.host_waited()

    def query(self) -> bool:
        self.host_waited()
        return True


class _InlineStream(Stream):
    """Runs what is launched on it at once; its waits order nothing that is not ordered already."""

    def launch(self, fn: Callable[[], None], *, timed: bool = False, nbytes: int = 0) -> tuple[None, None]:
        fn()
        return None, None

    def record_event(self) -> Event:
        return self.stamp(_Done(None, None))

    def wait_event(self, event: Event, *, timed: bool = False) -> None:
        return None

    def wait_stream(self, other: Stream) -> None:
        return None

    def retain(self, tensors: list[torch.Tensor]) -> None:
        return None  # every copy that read them already ran (or, on CUDA, precedes any reuse in compute order)


class InlineStreams(StreamBackend):
    """Compute, d2h and h2d all issue on the calling thread's current stream, at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin_memory = device.type == "cuda"
        clocks = VectorClocks(False)  # one order for all three: nothing to check
        self.compute, self.d2h, self.h2d = (_InlineStream(name, clocks) for name in ("compute", "d2h", "h2d"))
