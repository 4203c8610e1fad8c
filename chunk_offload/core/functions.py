"""The identity autograd function that marks where a group is committed.

NOTE [No node on group inputs]
A group is opened by a plain call (`OffloadManager.group_start`), not by an autograd node on
its inputs. An identity node there would sum the gradients of an input's uses inside the group
before adding those of its uses after the group; floating-point addition is not associative,
so gradients would differ in the last bits from training without offload whenever a group uses
an input twice and the input is used again later (a residual). `GroupCommit` sits on the
group's *new* outputs only (never on a leaf or on an input passed through), where all
downstream gradients are summed exactly as without it before flowing into the group.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .group import OffloadGroup

__all__ = ["GroupFunctions", "build_group_functions"]


class GroupFunctions(NamedTuple):
    commit: type[torch.autograd.Function]


def build_group_functions() -> GroupFunctions:
    """Build `GroupCommit`, used as ``GroupCommit.apply(group, *tensors)``.

    Forward commits ``group`` (its handler's open group) and starts its offload; backward (which
    autograd runs just before the group's own backward) makes the group resident, waiting for
    its reload, and prefetches the group before it. Returns its tensors as detached aliases.
    """

    class GroupCommit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, group: OffloadGroup, *tensors: torch.Tensor):
            # One argument that is not a tensor: each one costs autograd's apply a few microseconds.
            ctx.set_materialize_grads(False)
            ctx.group = group.handler.commit_group(group.name)
            return _alias(tensors)

        @staticmethod
        def backward(ctx, *grads):
            group = ctx.group
            group.handler.begin_group_backward(group)
            return (None, *grads)

    return GroupFunctions(GroupCommit)


def _alias(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    # An input returned as-is becomes a view of it, and autograd forbids in-place ops on views
    # made by a custom Function; a detached alias shares storage and version counter but is
    # not a view, so models that update activations in place keep working.
    return tuple([t.detach() for t in tensors])
