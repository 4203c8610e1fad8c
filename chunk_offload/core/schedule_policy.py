"""`SchedulePolicy`: what the engine asks the pipeline schedule about each chunk.

Three decisions need to know the order in which chunks run, which the engine itself does not:
whether a chunk's groups are worth offloading at all (its backward may follow at once), which
of its groups to copy (a device budget met by part of them), and which chunk to start
reloading ahead of its backward. The base class answers without a schedule: offload every
group of every chunk, and reload each group when backward reaches the group after it (NOTE
[Release and prefetch order] in handler.py). A fourth, schedule-free knob bounds how far
reloads run ahead within a chunk's backward. `chunk_offload.schedule.PlanPolicy`
answers from the rank's plan; users may subclass either.
"""

from __future__ import annotations

from typing import Sequence

from .actions import ChunkKey

__all__ = ["SchedulePolicy"]


class SchedulePolicy:
    """Offload every chunk; no reload ahead of the engine's own (one group ahead in backward)."""

    def begin_iteration(self) -> None:
        """A training iteration starts (the first action of the plan comes next)."""

    def offload_chunk(self, key: ChunkKey) -> bool:
        """Whether the groups of chunk ``key`` are copied to host (False: they stay on device)."""
        return True

    def offload_group(self, key: ChunkKey, index: int) -> bool:
        """Whether group ``index`` (forward order, 0-based) of chunk ``key`` is copied to host.

        Asked once at each group's commit, only for chunks `offload_chunk` offloads; False keeps
        the group on device (still accounted, never copied): a device budget met by offloading
        only some groups (`chunk_offload.schedule.choose_offload`).
        """
        return True

    def reload_ahead_bytes(self, key: ChunkKey) -> int | None:
        """In chunk ``key``'s backward, how many bytes of earlier groups may be reloading ahead of
        the running group (the group just before it always is); None: just that one group."""
        return None

    def prefetch_on(self, kind: str, key: ChunkKey) -> Sequence[tuple[ChunkKey, int | None]]:
        """Reloads to start when action ``kind`` (``"F"`` or ``"B"``) of chunk ``key`` begins.

        Returns ``(chunk, budget_bytes)`` pairs: the engine reloads that chunk's last groups
        (backward runs them first) while their bytes fit in the budget; a budget of None means
        the one group the chunk's backward needs first.
        ``"B"`` is reported when backward first reaches one of the chunk's groups.
        """
        return ()
