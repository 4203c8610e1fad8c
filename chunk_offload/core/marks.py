"""Group marks: what opens and commits an offload group inside a chunk's forward.

`GroupMarks` implements `OffloadManager.group_start` / `group_commit` (the low-level marks a
model calls itself); `ModuleOffload` calls them from a module's forward hooks
(`OffloadManager.offload_module`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from ._torch_compat import storage_key, top_saved_tensors_hooks, tree_flatten, tree_unflatten, view_base
from .errors import ChunkOffloadError
from .functions import build_group_functions
from .handler import ChunkOffloadHandler

if TYPE_CHECKING:
    from .manager import OffloadManager

__all__ = ["GroupMarks", "ModuleOffload"]

_NO_STORAGES: frozenset[int] = frozenset()


class GroupMarks:
    """Opens and commits the groups of the running chunk; owns the saved-tensor hooks it pushed."""

    def __init__(self) -> None:
        self._functions = build_group_functions()
        self._hooks_pushed: list[saved_tensors_hooks] = []

    def start(self, handler: ChunkOffloadHandler | None, tensors: Any, name: str) -> Any:
        """`OffloadManager.group_start` on the running chunk's ``handler``."""
        if handler is None or not torch.is_grad_enabled() or foreign_saved_tensors_hooks(handler):
            return tensors
        self.open(handler, _flatten(tensors)[0], name)
        return tensors

    def open(self, handler: ChunkOffloadHandler, inputs: list[torch.Tensor], name: str) -> None:
        """Open group ``name`` on ``handler`` with input tensors ``inputs`` and push its hooks.

        The caller checked that gradients are enabled and no foreign saved-tensor hook is active.
        """
        # A plain call, no autograd node on the inputs: see NOTE [No node on group inputs].
        group = handler.open_group(name)
        group.input_nodes = [node for t in inputs if (node := t.grad_fn) is not None]
        group.activations = _leaf_activation_storages(inputs)
        hooks = handler.saved_tensors_hooks
        hooks.__enter__()
        self._hooks_pushed.append(hooks)

    def commit(self, handler: ChunkOffloadHandler | None, tensors: Any, name: str) -> Any:
        """`OffloadManager.group_commit` on the running chunk's ``handler``."""
        if handler is None or not torch.is_grad_enabled():
            return tensors
        if handler.current is None and foreign_saved_tensors_hooks(handler):
            return tensors  # group_start skipped it: another saved-tensor hook owns this region
        group = handler.current
        if group is None or group.name != name:
            handler.commit_group(name)  # raises the precise error
        self._hooks_pushed.pop().__exit__(None, None, None)
        # Only outputs the group created pass through GroupCommit: a leaf (a parameter returned
        # as a bias) or an input handed back unchanged would have its gradient contributions
        # summed in another order (NOTE [No node on group inputs] in functions.py).
        inputs, group.input_nodes = group.input_nodes, ()  # no graph refs kept
        commit = self._functions.commit
        if type(tensors) is torch.Tensor:  # the common case, without flattening
            node = tensors.grad_fn
            if node is None or node in inputs:
                commit.apply(group)
                return tensors
            return commit.apply(group, tensors)[0]
        flat, spec = _flatten(tensors)
        marked = [i for i, t in enumerate(flat) if (node := t.grad_fn) is not None and node not in inputs]
        out = list(flat)
        aliases = commit.apply(group, *(flat[i] for i in marked))
        for i, alias in zip(marked, aliases):
            out[i] = alias
        return _unflatten(out, spec)

    def pop_all(self) -> None:
        """Leave every saved-tensor hook still pushed (the chunk ends)."""
        while self._hooks_pushed:
            self._hooks_pushed.pop().__exit__(None, None, None)


class ModuleOffload:
    """The forward hooks that make each call of one module an offload group.

    The hooks hold the manager weakly: a manager dropped without `close` is not kept alive by
    the model (its stream workers stop with it) and its hooks are removed when it is collected.
    """

    def __init__(
        self, manager: "OffloadManager", module: nn.Module, name: str, *, marks: GroupMarks, on_remove: Callable[["ModuleOffload"], None]
    ) -> None:
        self._manager = weakref.ref(manager)
        self._marks = marks  # the manager's own: the hooks open and commit through it, without its re-checks
        self.module = module
        self.name = name
        self._on_remove = on_remove
        self._opened: list[bool] = []  # per nested call: did the pre-hook open a group?
        self._handles = [
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post, with_kwargs=True, always_call=True),
        ]
        weakref.finalize(manager, _remove_handles, list(self._handles))

    @property
    def manager(self) -> "OffloadManager | None":
        """The manager that registered the module (None once it was collected)."""
        return self._manager()

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        manager = self.manager
        if manager is None:
            self._opened.append(False)
            return None
        handler = manager.current_handler
        if handler is None or not torch.is_grad_enabled() or foreign_saved_tensors_hooks(handler):
            self._opened.append(False)
            return None
        values = (*args, *kwargs.values()) if kwargs else args
        inputs = [a for a in values if isinstance(a, torch.Tensor)]
        try:
            self._marks.open(handler, inputs, self.name)
        except BaseException:
            self._opened.append(False)  # the always_call post hook runs next and must not commit
            raise
        self._opened.append(True)
        return None

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        manager = self.manager
        if not self._opened.pop() or manager is None:
            return None
        return self._marks.commit(manager.current_handler, output, self.name)

    def remove(self) -> None:
        """Remove the hooks; later calls of the module are not offloaded (idempotent)."""
        for handle in self._handles:
            handle.remove()
        if self._handles:
            self._on_remove(self)
        self._handles = []


def _remove_handles(handles: list) -> None:
    """Remove a collected manager's module hooks (a `weakref.finalize` callback: holds no manager)."""
    for handle in handles:
        handle.remove()


def _leaf_activation_storages(tensors: list[torch.Tensor]) -> frozenset[int]:
    """Storages of group inputs that are plain leaves requiring grad (or views of one).

    Such an input is an activation handed to the group (a pipeline stage's received input, a
    detached chunk input), not a parameter, so the policy's leaf rule must not keep it.
    """
    storages = [
        storage_key(t)
        for t in tensors
        if type(root := _root(t)) is torch.Tensor and root.is_leaf and root.requires_grad and t.layout == torch.strided
    ]
    return frozenset(storages) if storages else _NO_STORAGES


def _root(tensor: torch.Tensor) -> torch.Tensor:
    base = view_base(tensor)
    return base if base is not None else tensor


def foreign_saved_tensors_hooks(handler: ChunkOffloadHandler) -> bool:
    """Whether saved-tensor hooks other than ``handler``'s own are active (a non-reentrant
    checkpoint region, ``save_on_cpu``, ...): a group opened there would take their tensors.
    ``handler``'s own hooks (a group still open) fall through to the nesting error."""
    top = top_saved_tensors_hooks()
    return top is not None and getattr(top[0], "__self__", None) is not handler


def _flatten(tensors: Any) -> tuple[list[torch.Tensor], Any]:
    """Tensors among the pytree leaves of ``tensors``, and what `_unflatten` needs to put
    replacements back.

    Any pytree torch's utilities handle works (a tensor, tuples, lists, dicts, namedtuples, nested
    ones, registered output classes); leaves that are not tensors are kept as they are. A tensor
    and a plain tuple or list of tensors (what most layers take and return) skip torch's pytree.
    """
    if isinstance(tensors, torch.Tensor):
        return [tensors], None
    if type(tensors) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in tensors):
        return list(tensors), type(tensors)
    leaves, spec = tree_flatten(tensors)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    return [leaves[i] for i in positions], (leaves, positions, spec)


def _unflatten(out: list[torch.Tensor], spec: Any) -> Any:
    """The structure `_flatten` returned ``spec`` for, with its tensors replaced by ``out``."""
    if spec is None:
        return out[0]
    if spec is tuple or spec is list:
        return spec(out)
    leaves, positions, tree_spec = spec
    items = list(leaves)
    for i, t in zip(positions, out):
        items[i] = t
    return tree_unflatten(items, tree_spec)
