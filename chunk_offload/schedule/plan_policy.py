"""`PlanPolicy`: offload and prefetch decisions read from the rank's plan.

- Lifespan: a chunk whose backward follows its forward after fewer than ``min_lifespan``
  other actions (the last stage under 1F1B, where every ``F`` is followed by its ``B``) stays
  on device: a copy out and straight back would cost bandwidth and stall its backward.
- Prefetch: when the action just before a chunk's backward starts (a forward in steady
  1F1B, the previous backward in the cool-down), the reload of that chunk's last groups starts,
  so they are on device when its backward begins. ``prefetch_bytes`` bounds what is reloaded
  ahead, which bounds how far the stage's peak rises above reload-at-group-start; None
  reloads ahead the one group the chunk's backward needs first (when that backward starts,
  the engine reloads the group before it, overlapping the first group's backward).
- Per-group decisions (``offload_groups``, e.g. a `chunk_offload.schedule.OffloadChoice` for a
  device budget): exactly the listed groups of each chunk are copied, every other group stays
  on device; the lifespan rule is then not applied (the choice already weighed it).

`chunk_offload.schedule.simulate` predicts the resident bytes these decisions give.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from ..core.errors import ChunkOffloadError
from ..core.actions import ChunkKey
from ..core.schedule_policy import SchedulePolicy
from ..core.actions import Action, ActionKind
from .plan import Plan

if TYPE_CHECKING:
    from .budget import OffloadChoice

__all__ = ["PlanPolicy"]


class PlanPolicy(SchedulePolicy):
    """Offload by lifespan and prefetch the next backward chunk, from ``plan``.

    Args:
        plan: the rank's actions for one iteration.
        min_lifespan: offload a chunk only if at least this many actions run between its
            forward and its backward.
        prefetch_bytes: reload budget per chunk, issued during the action before its
            backward; None: the chunk's last group; 0: no plan-driven prefetch.
        reload_ahead_bytes: within a chunk's backward, bytes of earlier groups that may be
            reloading ahead of the running group (the one just before it always is); None:
            one group ahead.
        offload_groups: (microbatch, vp_stage) -> indices of the chunk's groups to copy (an
            `OffloadChoice`, or its ``offloaded`` mapping); every other group stays on device
            and ``min_lifespan`` is not applied. None: every group of an offloaded chunk.
    """

    def __init__(
        self,
        plan: Plan,
        *,
        min_lifespan: int = 1,
        prefetch_bytes: int | None = None,
        reload_ahead_bytes: int | None = None,
        offload_groups: "OffloadChoice | Mapping[tuple[int, int], Iterable[int]] | None" = None,
    ) -> None:
        if not isinstance(plan, Plan):
            raise ChunkOffloadError(f"PlanPolicy needs a chunk_offload.schedule.Plan, got {type(plan).__name__}")
        if not isinstance(min_lifespan, int) or min_lifespan < 0:
            raise ChunkOffloadError(f"min_lifespan must be an int >= 0, got {min_lifespan!r}")
        self.check_budgets(prefetch_bytes=prefetch_bytes, reload_ahead_bytes=reload_ahead_bytes)
        self.plan = plan
        self.min_lifespan = min_lifespan
        self.prefetch_bytes = prefetch_bytes
        self._reload_ahead_bytes = reload_ahead_bytes
        self._step = {a: i for i, a in enumerate(plan.actions)}
        self.offload_groups = _group_sets(offload_groups, plan)
        """The per-group decisions: (microbatch, vp_stage) -> group indices copied; None without."""
        if self.offload_groups is None:
            self._offload = {chunk: plan.lifespan(*chunk) >= min_lifespan for chunk in plan.chunks}
        else:
            self._offload = {chunk: bool(self.offload_groups.get(chunk)) for chunk in plan.chunks}

    @staticmethod
    def check_budgets(**budgets: int | None) -> dict[str, int | None]:
        """Raise unless every byte budget is None or an int >= 0; return them (for integrations
        that build the policy later, at the first training call, but should fail at once)."""
        for label, value in budgets.items():
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ChunkOffloadError(f"{label} must be None or an int >= 0, got {value!r}")
        return budgets

    def __repr__(self) -> str:
        return (
            f"PlanPolicy({self.plan.source}, min_lifespan={self.min_lifespan}, prefetch_bytes={self.prefetch_bytes}, "
            f"reload_ahead_bytes={self._reload_ahead_bytes}"
            + ("" if self.offload_groups is None else f", offload_groups={sum(map(len, self.offload_groups.values()))} groups")
            + ")"
        )

    def offload_chunk(self, key: ChunkKey) -> bool:
        # A chunk the plan does not know (the plan is wrong) is offloaded as without a plan.
        return self._offload.get(tuple(key), True)

    def offload_group(self, key: ChunkKey, index: int) -> bool:
        if self.offload_groups is None:
            return True
        return index in self.offload_groups.get(tuple(key), ())

    def reload_ahead_bytes(self, key: ChunkKey) -> int | None:
        return self._reload_ahead_bytes

    def kept_chunks(self) -> list[tuple[int, int]]:
        """Chunks this policy keeps on device, in forward order."""
        return [chunk for chunk, offload in self._offload.items() if not offload]

    def prefetch_on(self, kind: str, key: ChunkKey) -> Sequence[tuple[ChunkKey, int | None]]:
        if self.prefetch_bytes == 0:
            return ()
        step = self._step.get(Action(ActionKind(kind), key[0], key[1]))
        if step is None or step + 1 >= len(self.plan.actions):
            return ()
        following = self.plan.actions[step + 1]
        if following.kind is not ActionKind.BACKWARD or not self._offload.get(following.chunk, True):
            return ()
        return ((ChunkKey(*following.chunk), self.prefetch_bytes),)


def _group_sets(offload_groups, plan: Plan) -> dict[tuple[int, int], frozenset[int]] | None:
    """``offload_groups`` as (microbatch, vp_stage) -> frozenset of group indices, checked."""
    if offload_groups is None:
        return None
    mapping = getattr(offload_groups, "offloaded", offload_groups)
    if not isinstance(mapping, Mapping):
        raise ChunkOffloadError(
            f"offload_groups must be an OffloadChoice or a mapping (microbatch, vp_stage) -> group indices, "
            f"got {type(offload_groups).__name__}"
        )
    chunks = set(plan.chunks)
    out: dict[tuple[int, int], frozenset[int]] = {}
    for key, indices in mapping.items():
        chunk = tuple(key)
        if chunk not in chunks:
            raise ChunkOffloadError(
                f"offload_groups names chunk {key!r}, which is not in the plan ({plan.source}); "
                "chunks are the (microbatch, vp_stage) of the plan's forwards"
            )
        groups = frozenset(indices)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in groups):
            raise ChunkOffloadError(
                f"offload_groups[{key!r}] must hold group indices (ints >= 0), got {sorted(groups, key=repr)!r}"
            )
        out[chunk] = groups
    return out
