"""`ChunkOffloadHandler`: the offload groups of one (microbatch, virtual stage) chunk. It keeps
Transformer Engine's offload-handler protocol (``tensor_push``, ``tensor_pop``, ``on_group_commit_*``,
``bulk_*_group``, ``groupid_reset``) so TE's saved-tensor hook can drive it; named groups for our marks.

NOTE [Release and prefetch order]
Forward: committing group g issues its copies to host, then releases the device tensors of
the chunk's earlier groups, handing them to the copy stream (compute does not wait: NOTE
[Release by the copy stream] in copies.py). The copy of g thus overlaps the compute of g + 1
and later. When the chunk's forward ends, every group is released.
Backward runs groups in reverse: when group g's backward starts, compute waits for g's
reload (issued now if nobody prefetched it) and the reload of g - 1 is issued, so it overlaps
g's backward compute. A `SchedulePolicy` may start the reload of a chunk's last groups
earlier, during the action before the chunk's backward (`prefetch`), keep a chunk on device
(``offload=False``), or keep some of its groups (``offload_group``: the last groups of a chunk
whose backward follows at once, NOTE [Kept tail] in `ordering.py`). Which groups are reloaded early is
decided in `ordering.py` (NOTE [Reload order]).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .actions import ChunkKey
from .errors import ChunkOffloadError
from .engine_context import EngineContext, profile_range
from .group import OffloadGroup
from .group_state import GroupState, GroupStates, open_error
from .joins import CallJoins
from .saved import KeptRef, SavedRef
from .ordering import prefetch_selection, reload_ahead_selection

__all__ = ["ChunkOffloadHandler", "let_go_of_released"]

_TE_GROUP_NAME = "te_group"


class ChunkOffloadHandler:
    """Offload groups of one chunk, in forward order. See NOTE [Release and prefetch order]."""

    def __init__(
        self,
        ctx: EngineContext,
        key: ChunkKey,
        *,
        offload: bool = True,
        reload_ahead_bytes: int | None = None,
        offload_group: Callable[[int], bool] | None = None,
        probe_held: bool = False,
    ) -> None:
        self.ctx = ctx
        self._decide = ctx.decide
        self._capturing = ctx.streams.capturing  # asked at each group's open (NOTE [CUDA graph capture])
        self.key = key
        self.offload = offload
        """Whether committed groups are copied to host (False: kept on device, still accounted)."""
        self.offload_group = offload_group
        """With ``offload``: asked at each group's commit with its index, False keeps that group
        on device (`SchedulePolicy.offload_group`); None copies every group."""
        self.reload_ahead_bytes = reload_ahead_bytes
        """In backward, reload earlier groups while the bytes reloaded ahead fit (None: one group ahead)."""
        self.probe_held = probe_held
        """Without ``offload``: learn at the forward's end, without copies, which saved storages
        another reference holds (NOTE [Storages held elsewhere])."""
        self._learned: list[int] = []  # per group: bytes found held elsewhere at the forward's end
        self._shared: list[tuple[int, ...]] | None = None  # groups that saved one storage (`HeldElsewhere.shared_groups`); None: not looked for
        self.groups: list[OffloadGroup] = []
        self._states = GroupStates(self.groups)  # the ordering rules' view of `groups`
        self.current: OffloadGroup | None = None
        self._joins = CallJoins(ctx.layer_group_bytes)  # NOTE [Layer groups], [Bounded layer groups] and [Joined calls] in marks.py
        self._unreleased = 0
        self._holding: list[OffloadGroup] = []  # committed groups whose device tensors are still held
        self._backward_cursor = 0  # groups committed minus groups whose backward began (TE protocol)
        self._forward_ended = False  # finish_forward or abort ran: no new group may open
        self._backward_started = False

    def __repr__(self) -> str:
        return f"ChunkOffloadHandler{self.key}"

    @property
    def pack_hook(self) -> Callable[[torch.Tensor], Any]:
        """The pack hook our group marks push for the span of each named group (`tensor_push`
        without its ``**kwargs``, which would build a dict at every call)."""
        return self._pack

    @property
    def unpack_hook(self) -> Callable[[Any], torch.Tensor]:
        """The matching unpack hook (`tensor_pop` without ``**kwargs``)."""
        return self._unpack

    @property
    def released(self) -> bool:
        """Whether every group's saved tensors were consumed or freed."""
        return self._unreleased == 0 and self.current is None

    # ------------------------------------------------------------------ named groups
    def open_group(
        self, name: str, inputs: Sequence[torch.Tensor] = (), layer: object = None, if_shared: bool = False, joiner_of: str | None = None
    ) -> OffloadGroup:
        """Start collecting the tensors saved by one call of submodule ``name`` on ``inputs``.

        ``layer`` (not None): the call joins the pending group of the same layer, if any (NOTE [Layer groups] in marks.py);
        ``if_shared``: only if its first tensor to copy is a storage of that group (NOTE [Joined calls]); ``joiner_of``:
        the module its module joins (``joins``), for a bounded layer group (NOTE [Bounded layer groups])."""
        if self._forward_ended or self.current is not None or self._capturing():
            raise open_error(name, self.key, forward_ended=self._forward_ended, open_name=None if self.current is None else self.current.name)
        joined = self._joins.join(name, inputs, layer, if_shared, self._commit, joiner_of)
        if joined is not None:
            self.current = joined
            return joined
        group = OffloadGroup(self, name, len(self.groups), inputs)
        self.groups.append(group)
        self.current = group
        self._unreleased += 1
        return group

    def commit_group(self, name: str | None = None, layer: object = None) -> OffloadGroup:
        """Close the open group (checking its name) and start its offload; ``layer`` (not None): leave
        it pending instead, for the next call of ``layer`` to join. Returns the call's group."""
        if self._joins.tentative is not None:  # the call copied nothing
            self._settle_join(None)
        group = self.current
        if group is None:
            raise ChunkOffloadError(
                f"group {name!r} committed in chunk {self.key} but no group is open; "
                "call group_start before group_commit."
            )
        if name is not None and name != group.member:
            raise ChunkOffloadError(
                f"group {name!r} committed while group {group.member!r} is open in chunk {self.key}; "
                "start and commit of one group must use the same name."
            )
        self.current = None
        if layer is not None:
            self._joins.leave_pending(group, layer)
            return group
        self._commit(group)
        return group

    def _settle_join(self, first_key: int | None) -> OffloadGroup:
        """The tentatively joined call's first copied tensor views storage ``first_key``: its group,
        the joined one or one of its own (NOTE [Joined calls] in marks.py)."""
        undone = self._joins.settle(first_key, self._commit)
        if undone is None:
            return self.current
        name, inputs, input_nodes = undone
        self.current = None
        group = self.open_group(name, inputs)
        group.input_nodes = input_nodes
        return group

    def _commit(self, group: OffloadGroup) -> None:
        group.commit()
        self._backward_cursor = group.index + 1
        if self._holding:
            self._release_held()
        state = group.state
        if state is GroupState.OFFLOADING:
            self._holding.append(group)
        elif state is GroupState.KEPT and group.is_empty:
            self._group_released(group)
            group.release_empty()

    def finish_forward(self) -> None:
        """End of the chunk's forward: release every group's device tensors."""
        if self.current is not None:
            raise ChunkOffloadError(
                f"chunk {self.key} ended with group {self.current.name!r} still open; every group_start "
                "needs a group_commit inside the chunk."
            )
        self._joins.commit_pending(self._commit)
        self._forward_ended = True
        self._release_held()
        held = self.ctx.held_elsewhere
        if self.offload:
            if self.ctx.streams.copies_hold_sources:
                # Every copy issued so far, not only each group's own: another group's copy of the
                # same storage would still hold it (NOTE [Release by the copy stream] in copies.py).
                self.ctx.streams.d2h.synchronize()
            self._learned = [group.note_held_elsewhere() if group.state is GroupState.ON_HOST else 0 for group in self.groups]
        elif self.probe_held:
            self._learned = held.probe(self.key.vp_stage, self.groups)
        if self.offload or self.probe_held:  # what a device budget reads: not a kept chunk's cost
            self._shared = held.shared_groups(self.key.vp_stage, self.groups)

    def _release_held(self) -> None:
        if self._holding:
            holding, self._holding = self._holding, []
            for group in holding:
                group.release_device()

    def begin_group_backward(self, group: OffloadGroup) -> None:
        """Backward reached ``group``: make it resident and prefetch the group before it."""
        group.backward_begun = True
        group.ensure_resident()
        index = group.index
        if index < self._backward_cursor:
            self._backward_cursor = index
        if self.offload:  # otherwise no group of the chunk is on host: nothing to reload
            self._reload_ahead(index)
        if not self._backward_started:
            # After this chunk's own reloads, so that they come first on the copy stream.
            self._backward_started = True
            if self.ctx.on_backward_start is not None:
                self.ctx.on_backward_start(self)

    def _reload_ahead(self, index: int) -> None:
        """Backward reached group ``index``: start the reloads NOTE [Reload order] picks."""
        for i in reload_ahead_selection(self._states, index, self.reload_ahead_bytes):
            self.groups[i].reload()

    def prefetch(self, budget_bytes: int | None = None) -> int:
        """Start reloading the chunk's last groups ahead of its backward; returns the bytes issued.

        Which groups: `chunk_offload.core.ordering.prefetch_selection` (NOTE [Reload order]).
        """
        issued = 0
        for i in prefetch_selection(self._states, budget_bytes):
            group = self.groups[i]
            with profile_range(group, "prefetch"):
                group.reload()
            issued += group.saved_bytes
        return issued

    def group_bytes(self) -> list[int]:
        """Saved bytes of each committed group, in forward order."""
        return [g.saved_bytes for g in self.groups]

    def group_kept_bytes(self) -> list[int]:
        """Of `group_bytes`, the bytes each group keeps on device whatever the policy (pinned storages)."""
        return [g.kept_bytes for g in self.groups]

    def group_learned_bytes(self) -> list[int]:
        """Per group, the bytes found held elsewhere at the forward's end (copied for nothing, or
        probed): kept on device from then on (NOTE [Storages held elsewhere])."""
        return self._learned or [0] * len(self.groups)

    def group_shared(self) -> list[tuple[int, ...]] | None:
        """`HeldElsewhere.shared_groups` at the forward's end of a chunk that copies or probes; else None."""
        return None if self._shared is None else list(self._shared)

    def abort(self) -> None:
        """Discard every group now: copies finished, buffers returned, later unpacks raise."""
        self.ctx.streams.synchronize()
        self._forward_ended = True
        self.current = None
        self._joins.clear()
        self._holding = []
        for group in self.groups:
            group.discard()
        self._unreleased = 0

    def _group_released(self, group: OffloadGroup) -> None:
        self._unreleased -= 1

    # ------------------------------------------------------------------ TE protocol
    def tensor_push(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        """Pack hook: returns what autograd stores instead of ``tensor``."""
        return self._pack(tensor)

    def tensor_pop(self, tensor_tag: Any, **kwargs: Any) -> torch.Tensor:
        """Unpack hook: the saved tensor for ``tensor_tag`` returned by `tensor_push`."""
        return self._unpack(tensor_tag)

    # The hooks our own groups push (`saved_tensors_hooks`): `tensor_push` and `tensor_pop`
    # without their ``**kwargs``, which would build a dict at every call.
    def _pack(self, tensor: torch.Tensor) -> Any:
        group = self.current
        if group is None:
            group = self.open_group(_TE_GROUP_NAME)  # driven by TE's hook: groups are delimited by commits
        offload, key = self._decide(tensor, group.inputs)
        if offload:
            if self._joins.tentative is not None:
                group = self._settle_join(key)
            return group.save(tensor, key)
        return group.keep(tensor, key)

    def _unpack(self, tensor_tag: Any) -> torch.Tensor:
        tag_type = type(tensor_tag)
        if tag_type is SavedRef:
            owner = tensor_tag.group.handler  # None: its iteration is over (NOTE [No cycles per iteration])
            if owner is not self and owner is not None:
                raise ChunkOffloadError(f"tensor_pop of a tag of chunk {owner.key} on the handler of chunk {self.key}.")
            return tensor_tag.group.unpack(tensor_tag)
        if tag_type is KeptRef:
            return tensor_tag.unpack()
        if isinstance(tensor_tag, torch.Tensor):
            return tensor_tag
        raise ChunkOffloadError(
            f"tensor_pop got an unknown tag {tensor_tag!r} of type {type(tensor_tag).__name__}; "
            "expected a tag returned by tensor_push of this handler."
        )

    def on_group_commit_forward(self) -> None:
        """Commit the open group (opening an empty one if TE commits with nothing saved)."""
        if self.current is None:
            self.open_group(_TE_GROUP_NAME)
        self.commit_group()

    def on_group_commit_backward(self) -> None:
        """Backward reached the most recently committed group whose backward has not begun."""
        if self._backward_cursor == 0:
            raise ChunkOffloadError(f"on_group_commit_backward on chunk {self.key} with no committed group left.")
        self.begin_group_backward(self.groups[self._backward_cursor - 1])

    def bulk_offload_group(self, group_to_offload: int) -> None:
        """Start the copies to host of group ``group_to_offload`` (no-op if already issued)."""
        group = self._group(group_to_offload)
        if group.state is GroupState.COLLECTING:
            raise ChunkOffloadError(f"bulk_offload_group({group_to_offload}) on chunk {self.key}: the group is still open.")

    def bulk_reload_group(self, group_to_reload: int) -> None:
        """Start the copies back of group ``group_to_reload`` (no-op if not on host)."""
        self._group(group_to_reload).reload()

    def groupid_reset(self) -> None:
        """Start numbering backward from the last committed group again (a new backward pass)."""
        if self.current is not None:
            raise ChunkOffloadError(f"groupid_reset on chunk {self.key} while group {self.current.name!r} is open.")
        self._backward_cursor = len(self.groups)

    def _group(self, index: int) -> OffloadGroup:
        if not 0 <= index < len(self.groups):
            raise ChunkOffloadError(f"group id {index} is out of range for chunk {self.key} with {len(self.groups)} groups.")
        return self.groups[index]


def let_go_of_released(handlers: Sequence[ChunkOffloadHandler]) -> list[ChunkOffloadHandler]:
    """The ``handlers`` not all of whose groups are released yet; the groups of the others forget them.

    NOTE [No cycles per iteration]
    Each group names its handler and the handler lists its groups: a reference cycle that only the
    garbage collector frees. Left so, every iteration leaves its chunks' handlers and groups to the
    collector: host time in each collection, and objects that survive into the older generations,
    whose full collections stall a training process at unpredictable steps (Megatron-LM's
    ``--manual-gc`` exists for such stalls). `OffloadManager.end_iteration` passes every handler of
    the iteration and those still live from before; a released handler's groups forget it
    (`OffloadGroup.forget_handler`). Its hooks are bound at each use and its joins get the commit at
    each call, so nothing else points back to it: it still lists its groups, for whoever reads them
    after the iteration, and both are freed by reference counting.
    """
    live = []
    for handler in handlers:
        if handler.released:
            for group in handler.groups:
                group.forget_handler()
        else:
            live.append(handler)
    return live
