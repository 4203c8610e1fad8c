"""One offload group: the tensors one call of one submodule saved, and their copies.

A group moves through an explicit state machine (`GroupState`, group_state.py): every change goes
through `OffloadGroup._to`, checked against one table (`TRANSITIONS`), and every operation checks
the state it expects (`_expect`, or `internal_assert` for states only a bug of ours can produce),
so a call out of order is an error naming the state, never a silent wrong result.

Each saved tensor is represented by a `saved.SavedRef`, the object autograd keeps in its graph;
views of one storage share a `saved.Storage` that is copied once. When autograd drops the last
`SavedRef` of a storage (after the backward node that used it, or when the graph is freed) the
group frees that storage's device and host copies.
"""

from __future__ import annotations

from typing import Collection, Sequence

import torch

from ._torch_compat import storage_key
from .copies import copy_to_device, copy_to_host, release_after_copy
from .engine_context import EngineContext, profile_range
from .errors import internal_assert
from .group_state import TRANSITIONS, GroupHandler, GroupState, state_error
from .group_names import group_members, layer_group_name
from .saved import KeptRef, SavedRef, Storage, alive, fix_spans
from .slab import release_host
from .streams import Event

__all__ = ["OffloadGroup"]


_WAIT_RANGES = {"release_after_offload": "wait_offload", "use_after_reload": "wait_reload"}  # profiler range by wait name
# The states the per-tensor paths test, as globals (an Enum member lookup costs several global ones).
_COLLECTING, _KEPT, _DISCARDED = GroupState.COLLECTING, GroupState.KEPT, GroupState.DISCARDED


class OffloadGroup:
    """The saved tensors of one call of one named submodule within one chunk."""

    __slots__ = (  # one group per layer call: no per-instance dict for the garbage collector to track
        "handler", "key", "name", "member", "index", "state", "inputs", "input_nodes", "backward_begun", "saved_bytes", "kept_bytes", "copy_bytes", "copy_counted", "_ctx",
        "_storages", "_live_storages", "_kept_storages", "_kept_tensors", "_d2h_event", "_h2d_event", "_offload_cancelled",
    )  # fmt: skip

    def __init__(self, handler: GroupHandler, name: str, index: int, inputs: Sequence[torch.Tensor] = ()) -> None:
        self.handler: GroupHandler | None = handler
        """The chunk's handler; None once it let go of its iteration (NOTE [No cycles per iteration] in handler.py)."""
        self.key = handler.key  # the chunk's
        self.name = name  # its module's; a layer group's: its members' names joined by '+'
        self.member = name  # the name of the call collecting now (NOTE [Layer groups] in marks.py)
        self.index = index
        self.state = _COLLECTING
        self.inputs = inputs  # its input tensors while it collects (the leaf rule reads them); () once committed: no graph kept through them
        self.input_nodes: Collection = ()  # grad_fns of the group's inputs (set by group_start)
        self.backward_begun = False  # `ChunkOffloadHandler.begin_group_backward` ran for it
        self._ctx: EngineContext = handler.ctx
        self._storages: dict[int, Storage] = {}
        self._live_storages = 0
        self._kept_storages: set[int] | None = None  # storages of views the policy left on device
        self._kept_tensors = 0  # saved tensors the policy left on device (counted in stats at commit)
        self._d2h_event: Event | None = None
        self._h2d_event: Event | None = None
        self._offload_cancelled = False  # backward kept the originals while their copy to host was in flight
        self.saved_bytes = 0  # bytes accounted at commit (storage spans, deduplicated)
        self.kept_bytes = 0  # of those, bytes of storages kept on device (pinned): saved, never moved
        self.copy_bytes = self.copy_counted = 0  # while collecting: bytes to copy of its first storages (`joins.copy_bytes`)

    def __repr__(self) -> str:
        return f"OffloadGroup({self.name!r}, index={self.index}, chunk={self.key}, state={self.state.value})"

    # ------------------------------------------------------------------ helpers
    @property
    def is_empty(self) -> bool:
        """Whether the committed group holds no storage (it saved nothing offloadable that is alive)."""
        return not self._storages

    @property
    def storages(self) -> dict[int, Storage]:
        """The group's storages by key (read by NOTE [Storages held elsewhere]'s probe)."""
        return self._storages

    def _to(self, state: GroupState) -> None:
        """The one place a group changes state, checked against `TRANSITIONS`."""
        if state not in TRANSITIONS[self.state]:  # the message is built only when the check fails
            internal_assert(False, f"{self!r}: transition to {state.value!r} is not allowed")
        self.state = state

    def release_empty(self) -> None:
        """A committed group kept on device that holds nothing is released at once."""
        if not self.is_empty:
            internal_assert(False, f"release_empty of {self!r}, which holds storages")
        self._to(GroupState.RELEASED)

    def _expect(self, allowed: tuple[GroupState, ...], action: str) -> None:
        if self.state not in allowed:
            raise state_error(self.name, self.key, self.state, allowed, action)

    def _wait(self, stream, event: Event | None, name: str, timed_kind: str | None = None) -> None:
        ctx = self._ctx
        if event is None or name in ctx.skip_waits:
            return
        timed = ctx.measure_time and timed_kind is not None
        if ctx.profile_ranges and name in _WAIT_RANGES:
            with profile_range(self, _WAIT_RANGES[name]):
                timing = stream.wait_event(event, timed=timed)
        else:
            timing = stream.wait_event(event, timed=timed)
        if timing is not None:
            ctx.stats.timing(self.name, timed_kind, timing)

    # ------------------------------------------------------------------ forward
    def save(self, tensor: torch.Tensor, key: int | None = None) -> SavedRef:
        """Register a saved tensor of this group (the pack hook); ``key``: its `storage_key`."""
        if self.state is not _COLLECTING:
            self._expect((GroupState.COLLECTING,), "save a tensor into")
        if key is None:
            key = storage_key(tensor)  # unique while we hold the tensor, hence the storage
        storage = self._storages.get(key)
        if storage is None:
            storage = self._storages[key] = Storage(key)
            self._live_storages += 1
        return SavedRef(self, storage, tensor)

    def join(self, name: str, inputs: Sequence[torch.Tensor]) -> None:
        """A further call of the group's layer collects into it (NOTE [Layer groups] in marks.py)."""
        if self.state is not _COLLECTING:
            internal_assert(False, f"join of {name!r} into {self!r}")
        self.inputs, self.member = inputs, name
        members = group_members(self.name)
        if name not in members:
            self.name = layer_group_name([*members, name])

    def keep(self, tensor: torch.Tensor, pin_key: int = 0) -> KeptRef:
        """Register a saved tensor the policy leaves on device (too small, marked, a parameter).

        ``pin_key``: its storage's key where other saved views of that storage could be
        offloaded (the key `TensorFilter.decide` returns with False), else 0. At commit, offloaded
        views of such a storage are kept too: the kept view holds the whole storage on device, so
        a copy would free nothing while counting its bytes as moved.
        """
        if self.state is not _COLLECTING:
            self._expect((GroupState.COLLECTING,), "save a tensor into")
        self._kept_tensors += 1
        if pin_key:
            if self._kept_storages is None:
                self._kept_storages = set()
            self._kept_storages.add(pin_key)
        return KeptRef(tensor, self.name)

    def commit(self) -> None:
        """Close the group: fix each storage's span, account its bytes, start copies to host."""
        if self.state is not _COLLECTING:
            self._expect((GroupState.COLLECTING,), "commit")
        self.inputs = ()
        ctx = self._ctx
        stats = ctx.stats.group(self.name)
        stats.groups += 1
        handler = self.handler
        # See NOTE [Storages held elsewhere]: ordinals of live storages to keep at this place.
        held = ctx.held_elsewhere.kept(self.key.vp_stage, self.index, self.name)
        live = len(self._storages)
        saved_bytes, kept_bytes, kept_views, held_bytes = fix_spans(self._storages, self._kept_storages, held)
        self._live_storages -= live - len(self._storages)
        self._kept_storages = None
        stats.tensors_kept += self._kept_tensors + kept_views
        stats.bytes_kept_held_elsewhere += held_bytes
        self.saved_bytes = saved_bytes
        self.kept_bytes = kept_bytes
        ctx.resident.saved(saved_bytes)  # one change: the mark sees the group as a whole
        if (
            not handler.offload
            or (handler.offload_group is not None and not handler.offload_group(self.index))
            or all(storage.pinned for storage in self._storages.values())
        ):
            self._to(_KEPT)
            return
        try:
            with profile_range(self, "offload"):
                self._offload()
        except BaseException:
            # The bytes are accounted as saved: as a kept group, discard() or autograd frees them.
            self._to(GroupState.KEPT)
            raise

    def _offload(self) -> None:
        self._d2h_event = copy_to_host(self._ctx, self.name, self._storages.values(), self._wait)
        self._to(GroupState.OFFLOADING)

    def release_device(self) -> None:
        """Drop the device originals of the copied storages once their copy to host is ordered
        before any reuse of their memory (NOTE [Release by the copy stream] in copies.py). No-op
        when backward already reached the group (its offload was cancelled: RESIDENT) or autograd
        already freed all of it (RELEASED); any other state is a bug of ours."""
        if self.state in (GroupState.RESIDENT, GroupState.RELEASED):
            return
        if self.state is not GroupState.OFFLOADING:
            internal_assert(False, f"release_device of {self!r}")
        ctx = self._ctx
        moved = [storage for storage in self._storages.values() if storage.live and not storage.pinned]
        release_after_copy(ctx, self.name, moved, self._d2h_event, self._wait, "release of offloaded tensors of {!r}")
        if moved:
            no_memory = ctx.empties.on(moved[0].device_bytes.device)
            for storage in moved:
                storage.moved_to_host(no_memory)
            ctx.resident.moved_to_host(sum(storage.nbytes for storage in moved))
        self._to(GroupState.ON_HOST)

    def note_held_elsewhere(self) -> int:
        """At its chunk's forward end: learn which copied storages another reference keeps on
        device (NOTE [Storages held elsewhere]); returns their bytes. The handler waits first for
        copies that hold their sources (NOTE [Release by the copy stream] in copies.py)."""
        nbytes = self._ctx.held_elsewhere.learn(self.key.vp_stage, self.index, self.name, self._storages.values())
        if nbytes:
            self._ctx.stats.group(self.name).bytes_copied_held_elsewhere += nbytes
        return nbytes

    # ------------------------------------------------------------------ backward
    def on_output_grad(self, grad: torch.Tensor | None) -> None:
        """The hook on each output of the group's calls: the first complete gradient begins its backward
        (NOTE [Group backward hook]); a group its handler let go of (discarded with its iteration) raises at its first unpack."""
        if not self.backward_begun and self.handler is not None:
            self.handler.begin_group_backward(self)

    def reload(self) -> None:
        """Start the copies back to device (idempotent; prefetch and on-demand share it).

        No-op for a group already reloading or resident, kept on device, or released; an open
        or discarded group raises.
        """
        if self.state is GroupState.OFFLOADING:
            self._cancel_offload()
            return
        if self.state is not GroupState.ON_HOST:
            self._expect((GroupState.RELOADING, GroupState.RESIDENT, GroupState.KEPT, GroupState.RELEASED), "reload")
            return
        with profile_range(self, "reload"):
            self._reload()

    def _reload(self) -> None:
        pending = [storage for storage in self._storages.values() if storage.live and not storage.pinned]
        self._h2d_event = copy_to_device(self._ctx, self.name, pending, self._d2h_event, self._wait)
        self._to(GroupState.RELOADING)

    def _cancel_offload(self) -> None:
        """Backward reached the group before its device tensors were released: keep them."""
        for storage in self._storages.values():
            if storage.host is not None:
                release_host(self._ctx.pool, storage, self._d2h_event)
        self._offload_cancelled = True
        self._to(GroupState.RESIDENT)

    def ensure_resident(self) -> None:
        """Make compute wait for the group's reload, starting it if nobody prefetched it.

        No-op for a group resident, kept on device or released (it saved nothing alive); an
        open or discarded group raises (its tensors cannot be used).
        """
        if self.state is _KEPT:  # every group of a chunk that is not offloaded: one check
            return
        if self.state in (GroupState.ON_HOST, GroupState.OFFLOADING):
            self.reload()
        if self.state is GroupState.RELOADING:
            compute = self._ctx.streams.compute
            self._wait(compute, self._h2d_event, "use_after_reload", "wait_time_s")
            self._to(GroupState.RESIDENT)
            return
        self._expect((GroupState.RESIDENT, GroupState.KEPT, GroupState.RELEASED), "unpack a tensor of")

    def unpack(self, ref: SavedRef) -> torch.Tensor:
        """Return the saved tensor for autograd (the unpack hook)."""
        if not self.backward_begun and self.handler is not None:  # its gradient hook could not run: NOTE [Group backward hook]
            self.handler.begin_group_backward(self)  # (None: a discarded group of a finished iteration, which raises below)
        tensor = ref.tensor
        if tensor is not None:  # the device original is still held: nothing was released
            if tensor._version != ref.version:
                ref.check_version(self.name)
            return tensor
        ref.check_version(self.name)
        if self.state is not GroupState.RESIDENT:  # its first unpack: wait for the reload
            self.ensure_resident()
            self._expect((GroupState.RESIDENT,), "unpack a tensor of")
        event = self._h2d_event
        if event is not None and event.mark is not None:
            self._ctx.streams.compute.require(event.mark, rule="R2", what="use of a reloaded tensor of {!r}", subject=self.name)
        storage = ref.storage
        if storage.device_bytes is None:
            internal_assert(False, f"unpack of a freed storage in {self!r}")
        return storage.view_of(ref)

    # ------------------------------------------------------------------ lifetime
    def storage_freed(self, storage: Storage) -> None:
        """Autograd dropped the last saved view of ``storage``: free its copies (`SavedRef.__del__`).

        In a collecting group the storage is dropped at commit; a discarded one freed it already.
        """
        state = self.state
        if state is _KEPT and storage.host is None:  # nothing copied: only the accounting changes
            self._storage_released(storage)
            return
        if state is _DISCARDED or state is _COLLECTING:
            return
        ctx = self._ctx
        if state is GroupState.RELOADING:
            # Autograd dropped a prefetched tensor without using it. The reload may still write
            # its buffer, which was allocated on compute (NOTE [Reload allocation]): compute must
            # wait before the allocator can hand that memory to anything else.
            self.ensure_resident()
        if (state is GroupState.OFFLOADING or self._offload_cancelled) and storage.device_bytes is not None:
            # The offload's copy (in flight, or cancelled by backward) may still read the original.
            release_after_copy(ctx, self.name, [storage], self._d2h_event, self._wait, "free of the originals of {!r} while their offload may run")
        if storage.host is not None:
            release_host(ctx.pool, storage, self._d2h_event)
        self._storage_released(storage)

    def _storage_released(self, storage: Storage) -> None:
        """Drop what the group holds of ``storage`` and account it freed; release the group with its last one."""
        storage.drop()
        self._ctx.resident.freed(storage.nbytes, storage.on_host)
        self._live_storages -= 1
        if self._live_storages == 0:
            self._to(GroupState.RELEASED)
            self._let_go()
            self.handler._group_released(self)

    def forget_handler(self) -> None:
        """Drop the chunk's handler, released with its iteration (NOTE [No cycles per iteration] in handler.py)."""
        self.handler = None

    def _let_go(self) -> None:
        """Drop the storage records and copy events, unread once released or discarded: freed now, not with the handler (a cycle)."""
        self._storages.clear()
        self._d2h_event = self._h2d_event = None

    def discard(self) -> None:
        """Free every copy now (copy streams must be idle); later unpacks raise."""
        if self.state in (GroupState.RELEASED, GroupState.DISCARDED):
            return
        committed = self.state is not GroupState.COLLECTING
        for storage in self._storages.values():
            if storage.host is not None:
                release_host(self._ctx.pool, storage, None)
            if committed and storage.live:
                self._ctx.resident.freed(storage.nbytes, on_host=storage.on_host)
            for ref in alive(storage):
                ref.tensor = None
            storage.drop()
        self._let_go()
        self._to(GroupState.DISCARDED)
