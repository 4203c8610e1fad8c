"""The link-time cost `_budget_search` minimises when a `CopyTiming` is given (NOTE [Budget choice]).

A chunk's copied groups share the link inside one window, the compute between the chunk's
forward and its backward (`CopyTiming.window_s`): the chunk exposes the part of the round trip
of all its copied bytes that the window does not hide, ``max(0, round trip - window)``
(`CopyTiming.exposed_s`), and a choice exposes the sum over its chunks. A group's cost is what
it adds to its chunk's exposure, so it depends on what else the chunk copies: zero while the
chunk's copies still fit in its window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from ._budget_layout import Chunk

if TYPE_CHECKING:
    from .choice import CopyTiming

__all__ = ["Link"]


class Link:
    """Exposed link seconds of one plan's chunks for a measured `CopyTiming`."""

    def __init__(self, timing: "CopyTiming", steps: Mapping[Chunk, tuple[int, int]], order: Sequence[Chunk]) -> None:
        """``steps``: per chunk, the plan indices of its forward and backward; ``order``: the
        chunks in the order the search numbers them (`_Search.order`)."""
        self.timing = timing
        self.window = {chunk: timing.window_s(*steps[chunk]) for chunk in order}
        """Each chunk's window in seconds (`CopyTiming.window_s`)."""
        self.windows = np.array([self.window[chunk] for chunk in order], dtype=np.float64)
        """The same, by each chunk's index in ``order``."""

    def exposed(self, chunk: Chunk, nbytes: int) -> float:
        """Seconds of ``chunk``'s copies of ``nbytes`` in all that its window does not hide
        (`CopyTiming.exposed_s`'s arithmetic, the window computed once)."""
        return max(0.0, self.timing.round_trip_s(nbytes) - self.window[chunk]) if nbytes else 0.0

    def added(self, chunk: Chunk, before: int, change: int) -> float:
        """Exposed seconds that ``change`` more copied bytes add to a chunk copying ``before``
        (negative ``change``: the seconds keeping them on device gives back, as a negative)."""
        return self.exposed(chunk, before + change) - self.exposed(chunk, before)

    def added_each(self, chunks: np.ndarray, before: np.ndarray, change: np.ndarray) -> np.ndarray:
        """`added` for many groups at once: chunk indices (into ``order``), their chunks' copied
        bytes and each group's bytes (the same arithmetic, so the same values)."""
        windows = self.windows[chunks]
        after = np.maximum(0.0, self.timing.round_trip_s(before + change) - windows)
        return after - np.where(before > 0, np.maximum(0.0, self.timing.round_trip_s(before) - windows), 0.0)

    def total(self, moved: Mapping[Chunk, int]) -> float:
        """Exposed seconds of a whole choice, given each chunk's copied bytes (in their order)."""
        return sum((self.exposed(chunk, nbytes) for chunk, nbytes in moved.items()), 0.0)
