"""Predict a stage's saved-bytes accounting from its plan, without running the model.

`simulate` replays the engine's accounting events for every action of a plan, in the order
the engine issues them (see NOTE [Release and prefetch order] in core/handler.py), on the
same `ResidentBytes` counter the engine uses, so on CPU the prediction equals the manager's
measured peaks to the byte:

- forward of a chunk: the policy's prefetches for this action; then per group in forward
  order: its bytes are saved, then the group held since the previous commit is moved to host
  (at every commit, of a kept or empty group too); a group the policy copies
  (`SchedulePolicy.offload_group`) is then held until the next commit; at the end of the
  chunk the last held group moves;
- backward of a chunk, per group from the last: the group is reloaded if on host, the groups
  `chunk_offload.core.ordering.reload_ahead_selection` picks are reloaded (the same function
  the engine calls: one ahead; more while the policy's ``reload_ahead_bytes`` allow), on
  the first group the policy's prefetches for this action are issued, then autograd frees the
  group's bytes;
- zero-bubble plans (``W`` actions): a chunk's ``B`` reloads its groups and its ``W`` frees
  them (torch's input-gradient step runs with ``retain_graph=True``, so saved tensors live until
  the weight step; an approximation where the input-gradient step frees some of them). A chunk
  without ``W`` frees group by group at its ``B``: on torch's first stage the input-gradient
  step computes nothing and the weight step is the whole backward, so the plan has that chunk's
  ``B`` at the weight step and no ``W`` (NOTE [Zero-bubble weight steps]).

A chunk or group the policy keeps on device is saved and freed in backward, never moving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from ..core.errors import ChunkOffloadError
from ..core import ChunkKey, GroupState, prefetch_selection, reload_ahead_selection
from ..core.schedule_policy import SchedulePolicy
from ..core.stats import ResidentBytes
from ..core.actions import ActionKind
from .plan import Plan

__all__ = ["GroupBytes", "Simulation", "simulate"]

GroupBytes = Mapping[int, Sequence[int]] | Mapping[tuple[int, int], Sequence[int]] | Callable[[int, int], Sequence[int]]



@dataclass
class Simulation:
    """The predicted accounting of one iteration of a plan (fields as in `OffloadStats`)."""

    plan: Plan = field(repr=False)
    peak_saved_bytes: int
    """Peak of saved bytes: the stage's peak without offload."""
    peak_resident_bytes: int
    """Peak of device-resident saved bytes with offload under the policy."""
    host_bytes_at_saved_peak: int
    """Bytes on host at the moment of ``peak_saved_bytes``, with offload."""
    timeline_without: list[tuple[int, int]] = field(repr=False)
    """(step, saved bytes) after each accounting change, without offload."""
    timeline_with: list[tuple[int, int]] = field(repr=False)
    """(step, resident bytes) after each accounting change, with offload."""
    kept: list[tuple[int, int]] = field(default_factory=list)
    """Chunks the policy kept on device."""
    bytes_offloaded: int = 0
    """Bytes copied to host in the iteration."""

    @property
    def drop(self) -> int:
        """Predicted fall of the peak: ``peak_saved_bytes - peak_resident_bytes``."""
        return self.peak_saved_bytes - self.peak_resident_bytes


def simulate(
    plan: Plan,
    group_bytes: GroupBytes,
    *,
    policy: SchedulePolicy | None = None,
    offload: bool = True,
    kept_bytes: GroupBytes | None = None,
) -> Simulation:
    """Run ``plan``'s accounting with ``group_bytes`` per chunk and ``policy``'s decisions.

    ``group_bytes``: saved bytes of each offload group of a chunk, in forward order, keyed by
    vp_stage (every microbatch alike) or by (microbatch, vp_stage), or a callable of both.
    ``kept_bytes``: of those, the bytes each group keeps on device even when copied
    (`IterationRecord.group_kept_bytes`: NOTE [Storages held elsewhere]), keyed alike; None: none.
    """
    lookup = _lookup(group_bytes)
    kept_lookup = _lookup(kept_bytes) if kept_bytes is not None else None
    policy = policy if policy is not None else SchedulePolicy()
    base = _Run(plan, lookup, SchedulePolicy(), offload=False).run()
    run = _Run(plan, lookup, policy, offload=offload, kept_lookup=kept_lookup).run()
    return Simulation(
        plan=plan,
        peak_saved_bytes=base.resident.window.peak,
        peak_resident_bytes=run.resident.window.peak,
        host_bytes_at_saved_peak=run.resident.window.host_at_saved_peak,
        timeline_without=base.timeline,
        timeline_with=run.timeline,
        kept=run.kept,
        bytes_offloaded=run.bytes_offloaded,
    )


def _lookup(group_bytes: GroupBytes) -> Callable[[int, int], list[int]]:
    if callable(group_bytes):
        return lambda mb, vp: [int(b) for b in group_bytes(mb, vp)]
    if not isinstance(group_bytes, Mapping):
        raise ChunkOffloadError(f"group_bytes must be a mapping or a callable, got {type(group_bytes).__name__}")

    def lookup(mb: int, vp: int) -> list[int]:
        for key in ((mb, vp), vp):
            if key in group_bytes:
                return [int(b) for b in group_bytes[key]]
        raise ChunkOffloadError(f"group_bytes has no entry for chunk (microbatch={mb}, vp_stage={vp}) nor for vp_stage {vp}")

    return lookup


class _Run:
    """One pass over the plan with the engine's event order (see the module docstring)."""

    def __init__(
        self,
        plan: Plan,
        lookup: Callable[[int, int], list[int]],
        policy: SchedulePolicy,
        *,
        offload: bool,
        kept_lookup: Callable[[int, int], list[int]] | None = None,
    ) -> None:
        self.plan = plan
        self.lookup = lookup
        self.kept_lookup = kept_lookup
        self.policy = policy
        self.offload = offload
        self.resident = ResidentBytes()
        self.resident.start_window(trace=True)
        self.timeline: list[tuple[int, int]] = []
        self.step = 0
        self.bytes: dict[tuple[int, int], list[int]] = {}
        self.moved: dict[tuple[int, int], list[int]] = {}  # of `bytes`, what a copy moves
        self.state: dict[tuple[int, int], list[GroupState]] = {}
        self.kept: list[tuple[int, int]] = []
        self.bytes_offloaded = 0
        self.weight_steps = {a.chunk for a in plan.actions if a.kind is ActionKind.WEIGHT}

    def run(self) -> "_Run":
        self.policy.begin_iteration()
        for self.step, action in enumerate(self.plan.actions):
            if action.kind is ActionKind.FORWARD:
                self._forward(action.chunk)
            elif action.kind is ActionKind.BACKWARD:
                self._backward(action.chunk, free=action.chunk not in self.weight_steps)
            else:
                self._free_all(action.chunk)
        return self

    def _note(self) -> None:
        self.timeline.append((self.step, self.resident.resident))

    def _forward(self, chunk: tuple[int, int]) -> None:
        key = ChunkKey(*chunk)
        self._prefetch(self.policy.prefetch_on("F", key))
        offload = self.offload and self.policy.offload_chunk(key)
        if not offload and self.offload:
            self.kept.append(chunk)
        sizes = self.lookup(*chunk)
        self.bytes[chunk] = sizes
        kept = self.kept_lookup(*chunk) if self.kept_lookup is not None else [0] * len(sizes)
        moved = self.moved[chunk] = [n - k for n, k in zip(sizes, kept, strict=True)]
        states = self.state[chunk] = []
        held: list[int] = []
        for g, nbytes in enumerate(sizes):
            # NOTE as the engine's commit (OffloadGroup.commit, then ChunkOffloadHandler.commit_group):
            # the group's bytes are saved, then the group held since the previous commit is
            # released, at EVERY commit (a kept or empty group's too), then the group is held if copied.
            copied = offload and self.policy.offload_group(key, g) and moved[g] > 0
            self.resident.saved(nbytes)
            self._note()
            self._move_to_host(chunk, held)
            held = [g] if copied else []
            if copied:
                self.bytes_offloaded += moved[g]
            states.append(GroupState.OFFLOADING if copied else GroupState.KEPT if nbytes else GroupState.RELEASED)
        self._move_to_host(chunk, held)

    def _move_to_host(self, chunk: tuple[int, int], groups: list[int]) -> None:
        for g in groups:
            self.resident.moved_to_host(self.moved[chunk][g])
            self.state[chunk][g] = GroupState.ON_HOST
            self._note()

    def _groups(self, chunk: tuple[int, int]) -> list[tuple[GroupState, int]]:
        return list(zip(self.state[chunk], self.bytes[chunk]))

    def _reload(self, chunk: tuple[int, int], g: int) -> None:
        """A reload; reloading and resident are one state here (RESIDENT: no copy takes time)."""
        if self.state[chunk][g] is GroupState.ON_HOST:
            self.resident.moved_to_device(self.moved[chunk][g])
            self.state[chunk][g] = GroupState.RESIDENT
            self._note()

    def _backward(self, chunk: tuple[int, int], *, free: bool) -> None:
        states = self.state[chunk]
        budget = self.policy.reload_ahead_bytes(ChunkKey(*chunk))
        for g in reversed(range(len(states))):
            self._reload(chunk, g)
            self._reload_ahead(chunk, g, budget)
            if g == len(states) - 1:
                self._prefetch(self.policy.prefetch_on("B", ChunkKey(*chunk)))
            if free:
                self._free(chunk, g)

    def _reload_ahead(self, chunk: tuple[int, int], g: int, budget: int | None) -> None:
        for i in reload_ahead_selection(self._groups(chunk), g, budget):  # as the engine (NOTE [Reload order])
            self._reload(chunk, i)

    def _free(self, chunk: tuple[int, int], g: int) -> None:
        if self.state[chunk][g] in (GroupState.RESIDENT, GroupState.KEPT):
            self.resident.freed(self.bytes[chunk][g], on_host=False)
            self.state[chunk][g] = GroupState.RELEASED
            self._note()

    def _free_all(self, chunk: tuple[int, int]) -> None:
        for g in reversed(range(len(self.state[chunk]))):
            self._free(chunk, g)

    def _prefetch(self, requests) -> None:
        for key, budget in requests:
            chunk = tuple(key)
            if chunk not in self.state:
                continue  # not run forward yet: the engine skips it too
            for g in prefetch_selection(self._groups(chunk), budget):  # as the engine (NOTE [Reload order])
                self._reload(chunk, g)
