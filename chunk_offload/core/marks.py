"""Group marks: what opens and commits an offload group inside a chunk's forward.

`GroupMarks` implements `OffloadManager.group_start` / `group_commit` (the low-level marks a
model calls itself); `ModuleOffload` calls them from a module's forward hooks
(`OffloadManager.offload_module`).

NOTE [Group backward hook]
A group is opened and committed by plain calls (no autograd node), and backward reaches it
through a hook on the gradient of each output the group created (`Tensor.register_hook`'s
registration, `_torch_compat.add_gradient_hook`):
autograd runs the hook when that output's gradient is complete, before the group's own backward
nodes run, and the hook makes the group resident and reloads the one before it
(`ChunkOffloadHandler.begin_group_backward`). The hook returns None, so every gradient is
computed exactly as without offload, and the graph gains no node:
- an identity autograd Function on the *inputs* would sum the gradients of an input's uses
  inside the group before adding those of its uses after the group; floating-point addition is
  not associative, so gradients would differ in the last bits whenever a group uses an input
  twice and the input is used again later (a residual);
- one on the outputs is exact but costs a node and two Python calls per group, twice the host
  time of the hook.
Outputs the group did not create get no hook: a leaf (a parameter returned as a bias) or an
input handed back unchanged has its gradient complete only after the group's backward. With
several outputs the first complete gradient begins the group's backward. Where autograd drops
a hook (an output that is a view, modified in place after the group: torch rebuilds the view's
node), the group's first unpack begins its backward instead (`OffloadGroup.unpack`).

NOTE [Layer groups]
With ``OffloadConfig.group_by="layer"`` the calls of modules registered with one ``layer``
(`OffloadManager.offload_module`) that follow one another in a chunk's forward form one group: a
call's end leaves the group pending (``commit_group(..., layer)``), the next call of the same layer
joins it, and anything else that opens a group, or the chunk's forward end, commits it first. Each
call still pushes the saved-tensor hooks only for its own span and hooks its own outputs' gradients,
so the group saves exactly what the calls would save as groups of their own; what changes is that
its copies, events and stream switches are issued once per layer (NOTE [CUDA host path]), and its
reload is one. The group's copy starts when the layer's last offload module returns, not at each
module's end, so a layer's originals stay on device until then. The budget and the ordering rules
see one group per layer: they keep, copy and reload whole layers, so where a chunk's peak is at its
backward start (a kept tail, a reload ahead) it can hold up to a layer more than module groups would.

NOTE [Bounded layer groups]
With ``OffloadConfig.layer_group_bytes`` a layer's next call joins its pending group only while the
group holds fewer bytes to copy than the bound (`joins.joins_layer_group`; a storage counts its first
live saved view's bytes, read at the first join after it was saved: `joins.copy_bytes`); else the group commits and the call opens a group of its
own, which the layer's calls after it may join in turn. A group's host work (events, stream
switches, launches) costs the same whatever it copies, so small groups are where it shows: under a
bound of a few link-milliseconds' bytes small modules (norms at a small hidden size) share a group
while large ones (any module at hidden 4096) keep their own, whose peak module groups would have.
Past the bound the call of a module registered to join the call before it (``joins``: attn_proj
after core_attn) still joins, on condition as in NOTE [Joined calls], so the storage both save is
copied once. A call that copies nothing is joined by the next, so where a layer's bytes vary from
call to call (an MoE layer's experts, given the tokens the router picks) its groups may vary from
one microbatch to the next. The planner groups a layer's modules by the same rule on its own byte
model (`planner.grouping.merged_layer_group`); where a group's modelled bytes fall on the other
side of the bound from the engine's, the two group differently.

NOTE [Joined calls]
Two modules of one layer may save one storage: SDPA's output is core attention's saved output and
the attention projection's saved input. As groups of their own both copy it and both reload it:
link time and host memory spent on bytes that lower no peak. Under ``group_by="module"`` a module
registered with ``joins=<name>`` (`OffloadManager.offload_module`; the Megatron integration's
attn_proj, ``joins="core_attn"``) joins the group of the call of ``<name>`` before it in its layer
if it saves a storage of that group. The call of ``<name>`` stays pending at its end (as in layer
groups) and the joining call collects into it on trial (`joins.CallJoins`); its first tensor to copy
decides. A storage of the group keeps the join: the storage is copied and reloaded once, in one
group named ``<name>+<joiner>``. Anything else, or no tensor to copy by the call's end, undoes it:
the group commits as it was and the call opens a group of its own, as without ``joins`` (megatron's
local attention saves no output). Anything else that opens a group, or the forward's end, commits
the pending group, so a call of ``<name>`` not followed by its joiner stays alone. The copy of
``<name>``'s group thus starts when the join is decided, not at its own end; in backward a joined
pair reloads as one when the joining call's backward begins, where module groups would have
reloaded ``<name>``'s group one group ahead anyway. ``group_by="call"``: no joins; "layer": every
call of a layer joins. The planner models it (`planner.grouping.joined_groups`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Protocol

import torch
from torch import nn

from ._torch_compat import (
    add_gradient_hook,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    top_saved_tensors_hooks,
    tree_flatten,
)
from .errors import ChunkOffloadError
from .handler import ChunkOffloadHandler

__all__ = ["DetachedOffload", "GroupMarks", "HandlerSource", "ModuleOffload", "check_group_args"]


class HandlerSource(Protocol):
    """What module hooks read of their `OffloadManager`: the running chunk's handler (so marks
    need not import the manager, which imports them)."""

    @property
    def current_handler(self) -> ChunkOffloadHandler | None: ...


class GroupMarks:
    """Opens and commits the groups of the running chunk; owns the saved-tensor hooks it pushed."""

    def __init__(self) -> None:
        self._hooks_pushed = 0  # saved-tensor hooks pushed by open and not yet popped

    def start(self, handler: ChunkOffloadHandler | None, tensors: Any, name: str) -> Any:
        """`OffloadManager.group_start` on the running chunk's ``handler``."""
        if handler is None or not torch.is_grad_enabled() or foreign_saved_tensors_hooks(handler):
            return tensors
        self.open(handler, _tensors_of(tensors), name)
        return tensors

    def open(
        self, handler: ChunkOffloadHandler, inputs: list[torch.Tensor], name: str, layer: object = None, if_shared: bool = False,
        joiner_of: str | None = None,
    ) -> None:
        """Open group ``name`` on ``handler`` with input tensors ``inputs`` and push its hooks;
        ``layer``: join the pending group of that layer (NOTE [Layer groups]), ``if_shared``: only
        if the call saves a storage of it (NOTE [Joined calls]), ``joiner_of``: the module the
        call's module joins (NOTE [Bounded layer groups]).

        The caller checked that gradients are enabled and no foreign saved-tensor hook is active.
        """
        # A plain call, no autograd node on the inputs: see NOTE [Group backward hook].
        group = handler.open_group(name, inputs, layer, if_shared, joiner_of)
        # The inputs' nodes as they are now: an input modified in place inside the group gets a
        # node of the group, and an output that is that input is then an output the group created.
        group.input_nodes = [node for t in inputs if (node := t.grad_fn) is not None]
        push_saved_tensors_hooks(handler.pack_hook, handler.unpack_hook)
        self._hooks_pushed += 1

    def commit(self, handler: ChunkOffloadHandler | None, tensors: Any, name: str, layer: object = None) -> Any:
        """`OffloadManager.group_commit` on the running chunk's ``handler``; returns ``tensors`` as they are.

        ``layer``: leave the group pending for the layer's next call (NOTE [Layer groups]).
        """
        if handler is None or not torch.is_grad_enabled():
            return tensors
        if handler.current is None and foreign_saved_tensors_hooks(handler):
            return tensors  # group_start skipped it: another saved-tensor hook owns this region
        group = handler.current
        if group is None or group.member != name:
            handler.commit_group(name)  # raises the precise error
        pop_saved_tensors_hooks()
        self._hooks_pushed -= 1
        inputs, group.input_nodes = group.input_nodes, ()  # no graph refs kept
        group = handler.commit_group(name, layer)  # another group where a tentative join was undone
        # NOTE [Group backward hook]: a gradient hook on each output the group created.
        hook = group.on_output_grad
        if type(tensors) is torch.Tensor:  # the common case, without flattening
            node = tensors.grad_fn
            if node is not None and node not in inputs:
                add_gradient_hook(tensors, hook)
            return tensors
        for t in _tensors_of(tensors):
            node = t.grad_fn
            if node is not None and node not in inputs:
                add_gradient_hook(t, hook)
        return tensors

    def pop_all(self) -> None:
        """Leave every saved-tensor hook still pushed (the chunk ends)."""
        while self._hooks_pushed:
            pop_saved_tensors_hooks()
            self._hooks_pushed -= 1


class _OpenedStack(threading.local):
    """Per thread, whether each pre-hook call still in its module opened a group: forwards of one
    module on two threads may interleave, and each post-hook must pop its own thread's entry."""

    def __init__(self) -> None:
        self.stack: list[bool] = []


class ModuleOffload:
    """The forward hooks that make each call of one module an offload group.

    The hooks hold the manager weakly: a manager dropped without `close` is not kept alive by
    the model (its stream workers stop with it) and its hooks are removed when it is collected.
    A model that is pickled (``torch.save(model)``, ``copy.deepcopy``) takes inert hooks instead
    (`DetachedOffload`): the copy is not offloaded until it is registered with a manager.
    """

    def __init__(
        self,
        manager: HandlerSource,
        module: nn.Module,
        name: str,
        *,
        marks: GroupMarks,
        on_remove: Callable[["ModuleOffload"], None],
        layer: object = None,
        joins: str | None = None,
    ) -> None:
        self._manager = weakref.ref(manager)
        self._marks = marks  # the manager's own: the hooks open and commit through it, without its re-checks
        self.module = module
        self.name = name
        self.layer = layer
        """The layer whose calls form one group with this module's (NOTE [Layer groups]); None: its own group."""
        self.joins = joins
        """The module of the same layer whose pending group this module's call joins (NOTE [Joined calls])."""
        self.open_layer: object = layer
        """What a call's start passes `GroupMarks.open`: the layer whose pending group it joins, or None."""
        self.commit_layer: object = layer
        """What a call's end passes `GroupMarks.commit`: the layer for whose next call it stays pending, or None."""
        self.if_shared = False
        """Whether a call joins only if it saves a storage of the group (``joins`` without layer groups)."""
        self._on_remove = on_remove
        self._opened = _OpenedStack()  # per thread and nested call: did the pre-hook open a group?
        self._handles = [
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post, with_kwargs=True, always_call=True),
        ]
        weakref.finalize(manager, _remove_handles, list(self._handles))

    @property
    def manager(self) -> HandlerSource | None:
        """The `OffloadManager` that registered the module (None once it was collected)."""
        return self._manager()

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        manager = self._manager()
        if manager is None:
            self._opened.stack.append(False)
            return None
        handler = manager.current_handler
        if handler is None or not torch.is_grad_enabled() or foreign_saved_tensors_hooks(handler):
            self._opened.stack.append(False)
            return None
        values = (*args, *kwargs.values()) if kwargs else args
        inputs = [a for a in values if isinstance(a, torch.Tensor)]
        try:
            self._marks.open(handler, inputs, self.name, self.open_layer, self.if_shared, self.joins)
        except BaseException:
            self._opened.stack.append(False)  # the always_call post hook runs next and must not commit
            raise
        self._opened.stack.append(True)
        return None

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        manager = self._manager()
        if not self._opened.stack.pop() or manager is None:
            return None
        return self._marks.commit(manager.current_handler, output, self.name, self.commit_layer)

    def __reduce__(self) -> tuple:
        # The manager (streams, threads, weak references) is not part of the model's state.
        return (DetachedOffload, (self.name,))

    def remove(self) -> None:
        """Remove the hooks; later calls of the module are not offloaded (idempotent)."""
        for handle in self._handles:
            handle.remove()
        if self._handles:
            self._on_remove(self)
        self._handles = []


class DetachedOffload:
    """What a pickled or deep-copied `ModuleOffload` becomes: the same hooks with no manager, so
    they do nothing (the copy of the model belongs to no manager)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.layer = self.joins = self.open_layer = self.commit_layer = None
        self.if_shared = False
        self._opened = _OpenedStack()

    def __reduce__(self) -> tuple:
        return (DetachedOffload, (self.name,))

    @staticmethod
    def _manager() -> None:
        return None

    _pre = ModuleOffload._pre  # deepcopy keeps the hooks' functions and swaps in this object
    _post = ModuleOffload._post


def _remove_handles(handles: list) -> None:
    """Remove a collected manager's module hooks (a `weakref.finalize` callback: holds no manager)."""
    for handle in handles:
        handle.remove()


def foreign_saved_tensors_hooks(handler: ChunkOffloadHandler) -> bool:
    """Whether saved-tensor hooks other than ``handler``'s own are active (a non-reentrant
    checkpoint region, ``save_on_cpu``, ...): a group opened there would take their tensors.
    ``handler``'s own hooks (a group still open) fall through to the nesting error."""
    top = top_saved_tensors_hooks()
    return top is not None and getattr(top[0], "__self__", None) is not handler


def check_group_args(call: str, tensors: Any, name: object) -> None:
    """Refuse, at the call, a group name that is not a non-empty str and ``tensors`` without a tensor
    (`OffloadManager.group_start` / ``group_commit``; a module's own outputs are not checked)."""
    if type(name) is not str or not name:
        raise ChunkOffloadError(f"{call}(tensors, name) needs name as a non-empty str, got {name!r} ({type(name).__name__})")
    if type(tensors) is not torch.Tensor and not _tensors_of(tensors):
        raise ChunkOffloadError(
            f"{call}(tensors, name={name!r}) needs tensors as a tensor or a tuple, list, dict or other pytree "
            f"holding at least one tensor, got {tensors!r:.80} ({type(tensors).__name__}); pass the group's "
            f"{'input' if call == 'group_start' else 'output'} tensors"
        )


def _tensors_of(tensors: Any) -> list[torch.Tensor]:
    """The tensors among the pytree leaves of ``tensors``.

    Any pytree torch's utilities handle works (a tensor, tuples, lists, dicts, namedtuples, nested
    ones, registered output classes); leaves that are not tensors are skipped. A tensor and a
    plain tuple or list of tensors (what most layers take and return) skip torch's pytree.
    """
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if type(tensors) in (tuple, list):
        found = [t for t in tensors if isinstance(t, torch.Tensor)]
        if len(found) == len(tensors):
            return found
    return [leaf for leaf in tree_flatten(tensors)[0] if isinstance(leaf, torch.Tensor)]
