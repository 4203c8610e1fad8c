"""`PlanPolicy`: offload and prefetch decisions read from the rank's plan.

- Lifespan: in a chunk whose backward follows its forward after fewer than ``min_lifespan``
  other actions (PP=1, the last stage under 1F1B, where every ``F`` is followed by its ``B``)
  the first groups still wait for every later group's forward and backward: they are copied,
  and the last groups stay on device (`chunk_offload.core.kept_tail`, NOTE [Kept tail] in
  core/ordering.py: the last group; with a measured ``timing``, every last group whose copy out
  and back would not hide behind the compute after it). This needs the chunk's groups
  (``group_bytes``, e.g. a first iteration's `IterationRecord.group_bytes`); a chunk whose
  groups are not known yet stays on device whole.
- Prefetch: when the action just before a chunk's backward starts (a forward in steady
  1F1B, the previous backward in the cool-down), the reload of that chunk's last groups starts,
  so they are on device when its backward begins. ``prefetch_bytes`` bounds what is reloaded
  ahead, which bounds how far the stage's peak rises above reload-at-group-start; None
  reloads ahead the one group the chunk's backward needs first (when that backward starts,
  the engine reloads the group before it, overlapping the first group's backward).
- Reload ahead: within a chunk's backward, ``reload_ahead_bytes`` of earlier groups may be
  reloading ahead of the running one (`chunk_offload.core.reload_ahead_selection`). Without a
  value given, a measured timing (``timing``, or ``reload_timing`` for the reload-ahead alone)
  sets each offloaded chunk's budget: the smallest under which a model of the reload link
  predicts the least wait of compute on reloads (`chunk_offload.core.reload_ahead_budget`,
  NOTE [Timed reload ahead] in core/ordering.py); one group ahead where that already waits
  least, or without a timing. It changes when reloads start, never what is copied.
- Per-group decisions (``offload_groups``, e.g. a `chunk_offload.schedule.OffloadChoice` for a
  device budget): exactly the listed groups of each chunk are copied, every other group stays
  on device; the lifespan rule is then not applied (the choice already weighed it). The
  choice's predicted peak holds for the reload ahead it was made with, so no timing sets the
  budgets here: budgets derived from one (`PlanPolicy.reload_ahead_from`) may raise that peak,
  and under a device budget they are given per chunk (``chunk_reload_ahead``), as
  `chunk_offload.schedule.fit_reload_ahead` fits them under it.

`chunk_offload.schedule.simulate` predicts the resident bytes these decisions give.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping, NamedTuple, Sequence

from ..core.errors import ChunkOffloadError
from ..core.option_table import check_value, option
from ..core import GroupState, kept_tail, predicted_reload_wait, prefetch_selection, reload_ahead_budget
from ..core.actions import Action, ActionKind, ChunkKey
from ..core.schedule_policy import SchedulePolicy
from .choice import CopyTiming, OffloadChoice
from .plan import Plan
from .simulate import GroupBytes, _lookup

__all__ = ["PlanPolicy"]


class PlanPolicy(SchedulePolicy):
    """Offload by lifespan and prefetch the next backward chunk, from ``plan``.

    Args:
        plan: the rank's actions for one iteration.
        min_lifespan: a chunk with fewer actions between its forward and its backward copies
            only its first groups (NOTE [Kept tail]), or none while ``group_bytes`` does not
            know it.
        prefetch_bytes: reload budget per chunk, issued during the action before its
            backward; None: the chunk's last group; 0: no plan-driven prefetch.
        reload_ahead_bytes: within a chunk's backward, bytes of earlier groups that may be
            reloading ahead of the running group (the one just before it always is); None:
            derived per chunk from a timing (NOTE [Timed reload ahead]), else one group ahead;
            0: one group ahead, timing or not.
        offload_groups: (microbatch, vp_stage) -> indices of the chunk's groups to copy (an
            `OffloadChoice`, or its ``offloaded`` mapping); every other group stays on device
            and ``min_lifespan`` is not applied. None: every group of an offloaded chunk.
        group_bytes: saved bytes per group of each chunk, as `simulate` takes them, for the
            chunks ``min_lifespan`` concerns; None: those chunks stay on device whole.
        timing: a measured `CopyTiming` of the plan: the link rate and the compute seconds of
            those chunks (their forward and backward, spread over their groups by bytes) set
            how many last groups stay (`kept_tail`), and with the chunks' groups known and no
            ``reload_ahead_bytes`` given, the link rate back and each chunk's backward seconds
            set its reload-ahead budget; None: the last group, one group ahead.
        reload_timing: a measured `CopyTiming` for the reload-ahead budgets alone (the lifespan
            rule does not read it, so the bytes copied stay as without a timing); None: ``timing``.
        chunk_reload_ahead: (microbatch, vp_stage) -> that chunk's reload-ahead bytes, in place
            of any derived from a timing (`fit_reload_ahead`'s under a device budget); the other
            chunks reload ``reload_ahead_bytes`` ahead.
    """

    def __init__(
        self,
        plan: Plan,
        *,
        min_lifespan: int = 1,
        prefetch_bytes: int | None = None,
        reload_ahead_bytes: int | None = None,
        offload_groups: "OffloadChoice | Mapping[tuple[int, int], Iterable[int]] | None" = None,
        group_bytes: GroupBytes | None = None,
        timing: "CopyTiming | None" = None,
        reload_timing: "CopyTiming | None" = None,
        chunk_reload_ahead: Mapping[tuple[int, int], int] | None = None,
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
        self.group_bytes = group_bytes
        """The chunks' saved bytes per group the lifespan rule read (None: not known)."""
        self.timing = timing
        """The measured timing the lifespan rule read (None: not known)."""
        self.copied_head: dict[tuple[int, int], int] = {}
        """Chunks ``min_lifespan`` concerns, whose groups are known: how many first groups are copied."""
        if self.offload_groups is None:
            short = [chunk for chunk in plan.chunks if plan.lifespan(*chunk) < min_lifespan]
            if group_bytes is not None:
                self.copied_head = _copied_heads(plan, short, group_bytes, timing)
            self._offload = {chunk: True for chunk in plan.chunks}
            self._offload.update({chunk: self.copied_head.get(chunk, 0) > 0 for chunk in short})
        else:
            self._offload = {chunk: bool(self.offload_groups.get(chunk)) for chunk in plan.chunks}
        self.reload_timing = timing if reload_timing is None else reload_timing
        """The measured timing the reload-ahead budgets read (None: not known)."""
        self.timed_reload_ahead: dict[tuple[int, int], int] = {}
        """Chunks whose reload-ahead budget the timing set (NOTE [Timed reload ahead]), or
        ``chunk_reload_ahead``; the others reload ``reload_ahead_bytes`` ahead (None: one group)."""
        if chunk_reload_ahead is not None:
            row = option("ScheduleOptions.reload_ahead_bytes")
            self.timed_reload_ahead = {
                tuple(chunk): check_value(row, nbytes, name=f"chunk_reload_ahead[{tuple(chunk)}]") for chunk, nbytes in chunk_reload_ahead.items()
            }
        elif reload_ahead_bytes is None and self.offload_groups is None and group_bytes is not None and self.reload_timing is not None:
            self.timed_reload_ahead = self.reload_ahead_from(group_bytes, self.reload_timing)

    @staticmethod
    def check_budgets(**budgets: int | None) -> dict[str, int | None]:
        """Raise unless every byte budget is None or an int >= 0; return them (for integrations
        that build the policy later, at the first training call, but should fail at once)."""
        return {label: check_value(option(f"ScheduleOptions.{label}"), value) for label, value in budgets.items()}

    def __repr__(self) -> str:
        return (
            f"PlanPolicy({self.plan.source}, min_lifespan={self.min_lifespan}, prefetch_bytes={self.prefetch_bytes}, "
            f"reload_ahead_bytes={self._reload_ahead_bytes}"
            + (f", timed reload ahead in {len(self.timed_reload_ahead)} of {len(self.plan.chunks)} chunks" if self.timed_reload_ahead else "")
            + ("" if self.offload_groups is None else f", offload_groups={sum(map(len, self.offload_groups.values()))} groups")
            + ")"
        )

    def offload_chunk(self, key: ChunkKey) -> bool:
        # A chunk the plan does not know (the plan is wrong) is offloaded as without a plan.
        return self._offload.get(tuple(key), True)

    def offload_group(self, key: ChunkKey, index: int) -> bool:
        if self.offload_groups is None:
            head = self.copied_head.get(tuple(key))
            return head is None or index < head
        return index in self.offload_groups.get(tuple(key), ())

    def reload_ahead_bytes(self, key: ChunkKey) -> int | None:
        return self.timed_reload_ahead.get(tuple(key), self._reload_ahead_bytes)

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

    def reload_ahead_from(self, group_bytes: GroupBytes, timing: "CopyTiming") -> dict[tuple[int, int], int]:
        """Each offloaded chunk's reload-ahead budget from ``timing`` where one group ahead would wait
        (NOTE [Timed reload ahead]) under this policy's decisions (`_backward_models`)."""
        budgets = {}
        for model in self._backward_models(group_bytes, timing):
            budget = reload_ahead_budget(model.groups, reload_bytes_per_s=model.rate, backward_s=model.backward_s, on_host_at_s=model.on_host_at_s)
            if budget is not None:
                budgets[model.chunk] = budget
        return budgets

    def predicted_reload_waits(self, group_bytes: GroupBytes, timing: "CopyTiming") -> dict[tuple[int, int], float]:
        """Per offloaded chunk, the seconds compute is predicted to wait on reloads in its backward
        under its reload-ahead budget, on the model of NOTE [Timed reload ahead]
        (`chunk_offload.core.predicted_reload_wait`)."""
        return {
            model.chunk: predicted_reload_wait(
                model.groups, self.reload_ahead_bytes(ChunkKey(*model.chunk)), reload_bytes_per_s=model.rate,
                backward_s=model.backward_s, on_host_at_s=model.on_host_at_s,
            )  # fmt: skip
            for model in self._backward_models(group_bytes, timing)
        }

    def _backward_models(self, group_bytes: GroupBytes, timing: "CopyTiming") -> Iterator["_BackwardModel"]:
        """Per offloaded chunk whose groups ``group_bytes`` knows, the inputs of NOTE [Timed reload ahead]'s model."""
        lookup = _lookup(group_bytes)
        rate = timing.bytes_per_s if timing.reload_bytes_per_s is None else timing.reload_bytes_per_s
        for chunk in self.plan.chunks:
            try:
                sizes = lookup(*chunk)
            except ChunkOffloadError:  # a chunk ``group_bytes`` does not know reloads one group ahead
                continue
            if not self._offload[chunk] or not sizes:
                continue
            key = ChunkKey(*chunk)
            groups = [(_state_at_backward(nbytes, self.offload_group(key, g)), nbytes) for g, nbytes in enumerate(sizes)]
            for g in self._prefetched(chunk, groups):
                groups[g] = (GroupState.RELOADING, sizes[g])
            seconds = _group_seconds(self.plan, timing, chunk, sizes, since=ActionKind.BACKWARD)
            yield _BackwardModel(chunk, groups, rate, seconds, _on_host_at(self.plan, timing, chunk, groups))

    def _prefetched(self, chunk: tuple[int, int], groups: list[tuple[GroupState, int]]) -> list[int]:
        """The groups of ``chunk`` this policy prefetches during the action before its backward
        (none where that is its own forward, which the engine skips, or a ``W``, which it does not see)."""
        backward = self.plan.index(ActionKind.BACKWARD, *chunk)
        before = self.plan.actions[backward - 1] if backward > 0 else None
        if before is None or before.kind is ActionKind.WEIGHT or before.chunk == chunk:
            return []
        asked = [budget for key, budget in self.prefetch_on(before.kind.value, ChunkKey(*before.chunk)) if tuple(key) == chunk]
        return prefetch_selection(groups, asked[0]) if asked else []


def _copied_heads(plan: Plan, chunks: list[tuple[int, int]], group_bytes: GroupBytes, timing: "CopyTiming | None") -> dict[tuple[int, int], int]:
    """For each of ``chunks`` (backward right after forward): how many first groups are copied (NOTE [Kept tail])."""
    lookup = _lookup(group_bytes)
    heads = {}
    for chunk in chunks:
        sizes = lookup(*chunk)
        rate = back = compute = None
        if timing is not None and sizes:
            rate, back = timing.bytes_per_s, timing.reload_bytes_per_s
            compute = _group_seconds(plan, timing, chunk, sizes, since=ActionKind.FORWARD)
        heads[chunk] = len(sizes) - kept_tail(sizes, bytes_per_s=rate, compute_s=compute, reload_bytes_per_s=back)
    return heads


class _BackwardModel(NamedTuple):
    """One chunk's inputs of NOTE [Timed reload ahead]'s model."""

    chunk: tuple[int, int]
    groups: list[tuple[GroupState, int]]
    """Its groups as its backward finds them: copied ones on host, a prefetch during the action before reloading."""
    rate: float
    """The link rate back."""
    backward_s: list[float]
    """Its groups' backward seconds."""
    on_host_at_s: list[float] | None
    """Per group, seconds after the backward's start at which its copy to host ends (`_on_host_at`)."""


def _on_host_at(plan: Plan, timing: "CopyTiming", chunk: tuple[int, int], groups: list[tuple[GroupState, int]]) -> list[float] | None:
    """Where ``chunk``'s backward follows its forward at once: per group, the seconds after the
    backward's start at which its copy to host ends (NOTE [Timed reload ahead]); None elsewhere,
    where other actions run between them (the chunk-level link queue, NOTE [Link queue], weighs those).

    Each copied group's copy enters the link to host at its commit, the forward's measured
    seconds spread over the groups by bytes (as `_group_seconds` spreads them), after the copies
    before it, at the measured rate to host. On CPU streams a chunk's forward end waits for its
    copies (they hold their sources: NOTE [Release by the copy stream] in core/copies.py), so the
    measured forward already contains them and the model errs towards waiting there; on CUDA the
    forward does not wait.
    """
    forward, backward = plan.index(ActionKind.FORWARD, *chunk), plan.index(ActionKind.BACKWARD, *chunk)
    if backward != forward + 1:
        return None
    span = max(0.0, timing.action_starts_s[backward] - timing.action_starts_s[forward])
    total = sum(nbytes for _, nbytes in groups)
    committed = free = 0.0
    out = []
    for state, nbytes in groups:
        committed += span * nbytes / total if total else span / len(groups)
        if state is GroupState.ON_HOST:
            free = max(free, committed) + nbytes / timing.bytes_per_s
        out.append(free - span if state is GroupState.ON_HOST else 0.0)
    return out


def _state_at_backward(nbytes: int, copied: bool) -> GroupState:
    """A group's state when its chunk's backward starts, before any prefetch (as `simulate` has it)."""
    if not nbytes:
        return GroupState.RELEASED
    return GroupState.ON_HOST if copied else GroupState.KEPT


def _group_seconds(plan: Plan, timing: "CopyTiming", chunk: tuple[int, int], sizes: list[int], *, since: ActionKind) -> list[float]:
    """The measured seconds from the start of ``chunk``'s ``since`` action to the end of its backward,
    spread over its groups by bytes.

    Assumes each group computes in proportion to its saved bytes (the compute of modules between
    offloaded ones falls to the groups around them). The backward ends where the next action the
    engine sees starts (a zero-bubble ``W``, which starts with the action before it in a
    `CopyTiming`, counts in its ``B``), the last at the iteration's end; the measured seconds
    include any wait of compute on copies in that iteration.
    """
    starts = timing.action_starts_s
    backward = plan.index(ActionKind.BACKWARD, *chunk)
    after = next((i for i in range(backward + 1, len(plan.actions)) if plan.actions[i].kind is not ActionKind.WEIGHT), None)
    end = timing.iteration_s if after is None else starts[after]
    span = max(0.0, end - starts[plan.index(since, *chunk)])
    total = sum(sizes)
    return [span * b / total if total else span / len(sizes) for b in sizes]


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
