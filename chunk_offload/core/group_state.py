"""`GroupState`: the states an offload group moves through, and the one table of allowed changes.

`OffloadGroup._to` (group.py) is the only place a group changes state; it checks the change
against `TRANSITIONS`, so a call out of order is an error naming the state, never a silent
wrong result. `chunk_offload.schedule.simulate` and the ordering rules read the same states.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Protocol, Sequence

from .errors import ChunkOffloadError

__all__ = ["GroupHandler", "GroupState", "GroupStates", "TRANSITIONS", "open_error", "state_error"]


class GroupState(enum.Enum):
    __hash__ = object.__hash__  # members are unique: C identity hash for `TRANSITIONS` lookups, not Enum's name hash
    COLLECTING = "collecting"  # the group's forward runs; tensors are being saved
    KEPT = "kept"  # committed without offload (offload disabled, the policy keeps it, or nothing to move)
    OFFLOADING = "offloading"  # copies to host issued; device tensors still held
    ON_HOST = "on_host"  # device tensors released; only the host copy exists
    RELOADING = "reloading"  # copies back issued; compute has not waited yet
    RESIDENT = "resident"  # on device and safe to use by compute
    RELEASED = "released"  # every saved tensor was consumed or freed by autograd
    DISCARDED = "discarded"  # its chunk or iteration raised; nothing may be unpacked


_S = GroupState
TRANSITIONS: dict[GroupState, frozenset[GroupState]] = {
    _S.COLLECTING: frozenset({_S.KEPT, _S.OFFLOADING, _S.DISCARDED}),
    _S.KEPT: frozenset({_S.RELEASED, _S.DISCARDED}),
    # -> RESIDENT: backward reached the group before its device tensors were released (cancel)
    _S.OFFLOADING: frozenset({_S.ON_HOST, _S.RESIDENT, _S.RELEASED, _S.DISCARDED}),
    _S.ON_HOST: frozenset({_S.RELOADING, _S.RELEASED, _S.DISCARDED}),
    _S.RELOADING: frozenset({_S.RESIDENT, _S.DISCARDED}),
    _S.RESIDENT: frozenset({_S.RELEASED, _S.DISCARDED}),
    _S.RELEASED: frozenset(),
    _S.DISCARDED: frozenset(),
}
"""Every allowed change of a group's state; `OffloadGroup._to` refuses any other."""


def state_error(name: str, chunk: Any, state: GroupState, allowed: tuple[GroupState, ...], action: str) -> ChunkOffloadError:
    """The error for ``action`` on group ``name`` of ``chunk`` in ``state``, which ``allowed`` does not hold."""
    if state is GroupState.DISCARDED:
        return ChunkOffloadError(
            f"cannot {action} group {name!r} of chunk {chunk}: the group was discarded (its chunk or "
            "iteration raised an exception, or the iteration was discarded). Run the forward again."
        )
    return ChunkOffloadError(
        f"cannot {action} group {name!r} of chunk {chunk} in state {state.value!r}; allowed states: {[s.value for s in allowed]}"
    )


def open_error(name: str, chunk: Any, *, forward_ended: bool, open_name: str | None) -> ChunkOffloadError:
    """Why group ``name`` cannot open on ``chunk``'s handler now (`ChunkOffloadHandler.open_group`'s
    checks, in their order): its forward ended, group ``open_name`` is open, or a CUDA graph is capturing."""
    if forward_ended:
        return ChunkOffloadError(
            f"group {name!r} started on the handler of chunk {chunk} after that chunk's forward ended; "
            "a handler serves one forward: enter manager.chunk(...) for each forward and use the handler it "
            "yields (a Transformer Engine style handler reused across iterations is not supported)."
        )
    if open_name is not None:
        return ChunkOffloadError(
            f"group {name!r} started while group {open_name!r} of chunk {chunk} is still open; "
            "offload groups cannot nest. Commit the open group first, or offload only one of the nested modules."
        )
    return ChunkOffloadError(  # NOTE [CUDA graph capture] in streams/base.py
        f"group {name!r} of chunk {chunk} started while a CUDA graph is being captured on the compute stream "
        "(torch.cuda.graph, megatron-core's cuda_graph_impl, Transformer Engine's make_graphed_callables): a "
        "graph's replays run without the hooks that copy saved tensors to host and back. Keep offloaded modules "
        "out of captured regions (megatron-core: --cuda-graph-impl none, or a --cuda-graph-scope without them), "
        "or do not offload them."
    )


class GroupHandler(Protocol):
    """What an `OffloadGroup` needs of its chunk's handler (a `ChunkOffloadHandler`; typed here,
    below both, so that group.py does not import handler.py)."""

    ctx: Any  # the `EngineContext`
    key: Any  # the `ChunkKey`
    offload: bool
    offload_group: Callable[[int], bool] | None

    def begin_group_backward(self, group: Any) -> None: ...

    def _group_released(self, group: Any) -> None: ...


class GroupStates(Sequence[tuple[GroupState, int]]):
    """The chunk's groups as ``(state, saved_bytes)`` pairs, read on access.

    The ordering rules (`ordering.py`) take this sequence; a lazy view lets the rule that
    looks at one neighbour read one group, not build a list of all of them at each group's
    backward (quadratic in the groups of a chunk).
    """

    __slots__ = ("_groups",)

    def __init__(self, groups: list[Any]) -> None:  # the handler's `OffloadGroup`s
        self._groups = groups

    def __len__(self) -> int:
        return len(self._groups)

    def __getitem__(self, i: int | slice):  # one pair, or a list of pairs for a slice
        if isinstance(i, slice):
            return [(g.state, g.saved_bytes) for g in self._groups[i]]
        group = self._groups[i]
        return group.state, group.saved_bytes
