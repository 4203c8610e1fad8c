"""The identity autograd functions that mark where a group starts and where it is committed.

`GroupStart` sits on the group's inputs and `GroupCommit` on its outputs, so autograd runs
``GroupCommit.backward`` just before the group's backward and ``GroupStart.backward`` just
after it. They carry no tensors in ``ctx``; the handler and group are plain attributes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .handler import ChunkOffloadHandler
from .group import OffloadGroup

__all__ = ["GroupFunctions", "build_group_functions"]


class GroupFunctions(NamedTuple):
    start: type[torch.autograd.Function]
    commit: type[torch.autograd.Function]


def build_group_functions() -> GroupFunctions:
    """Build the `GroupStart` / `GroupCommit` pair.

    ``GroupStart.apply(handler, name, *tensors)``: forward opens group ``name`` in ``handler``;
    backward marks the group's backward done.
    ``GroupCommit.apply(handler, name, *tensors)``: forward commits the group and starts its
    offload; backward makes the group resident (waiting for its reload) and prefetches the next.
    Both return their tensors unchanged (as a tuple of aliases).
    """

    class GroupStart(torch.autograd.Function):
        @staticmethod
        def forward(ctx, handler: ChunkOffloadHandler, name: str, *tensors: torch.Tensor):
            ctx.set_materialize_grads(False)
            ctx.handler = handler
            ctx.group = handler.open_group(name)
            return _alias(tensors)

        @staticmethod
        def backward(ctx, *grads):
            ctx.handler.end_group_backward(ctx.group)
            return (None, None, *grads)

    class GroupCommit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, handler: ChunkOffloadHandler, name: str, *tensors: torch.Tensor):
            ctx.set_materialize_grads(False)
            ctx.handler = handler
            ctx.group: OffloadGroup = handler.commit_group(name)
            return _alias(tensors)

        @staticmethod
        def backward(ctx, *grads):
            ctx.handler.begin_group_backward(ctx.group)
            return (None, None, *grads)

    return GroupFunctions(GroupStart, GroupCommit)


def _alias(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    # An input returned as-is becomes a view of it, and autograd forbids in-place ops on views
    # made by a custom Function; a detached alias shares storage and version counter but is
    # not a view, so models that update activations in place keep working.
    return tuple(t.detach() for t in tensors)
