"""`Exchange`: one integer per rank, all-gathered over a group the integration owns.

The budgets need two collectives: every pipeline rank's lowest peak (``device_budget="auto"``)
and every node rank's host need (a node host budget). Both run on process groups created for
them at attach time (`dedicated_group`), so that they never interleave with the framework's own
traffic on its groups (Megatron's pipeline sends, the schedule's p2p).

NOTE [Deferred exchanges]
An exchange is issued where a training iteration closes. Where every rank is at the same point
of the program then (after ``forward_backward_func`` returns, after ``schedule.step``) it is
waited for at once (``blocking=True``). Megatron's automatic iterations close lazily, at the
next step's first chunk forward, where a later pipeline rank is still waiting for its input:
a blocking collective there would deadlock. There the exchange is asynchronous and waited for
when the next iteration closes (``blocking=False``), so its result applies one iteration later:
by then every rank has issued it, since no rank can finish an iteration before every rank of its
pipeline began it, and the optimizer step synchronizes the data-parallel ranks.
"""

from __future__ import annotations

import socket
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["Exchange", "dedicated_group", "node_ranks"]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def dedicated_group(ranks: Sequence[int]) -> dist.ProcessGroup | None:
    """COLLECTIVE over the default group: a new process group with the same ``ranks`` (this rank's).

    Every rank passes its own group's ranks; the distinct groups are created on every rank in
    one order (``new_group`` is collective). None without torch.distributed.
    """
    if not _initialized():
        return None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(int(r) for r in ranks))
    mine = None
    for group_ranks in sorted({tuple(r) for r in everyone}):
        group = dist.new_group(list(group_ranks))
        if dist.get_rank() in group_ranks:
            mine = group
    return mine


def node_ranks() -> list[int]:
    """COLLECTIVE over the default group: the global ranks on this rank's host (by host name)."""
    if not _initialized():
        return [0]
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return [rank for rank, host in enumerate(hosts) if host == hosts[dist.get_rank()]]


class _Gathered:
    """An all-gather under way (or done) and its result."""

    def __init__(self, value: int, group: dist.ProcessGroup | None) -> None:
        self._work = None
        if group is None:
            self._tensors = [torch.tensor([value], dtype=torch.int64)]
            return
        cuda = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        mine = torch.tensor([value], dtype=torch.int64, device=device)
        self._tensors = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        self._work = dist.all_gather(self._tensors, mine, group=group, async_op=True)

    def wait(self) -> list[int]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return [int(t.item()) for t in self._tensors]


class Exchange:
    """All-gathers of one int per rank over ``group`` (None: this process alone), in group rank order.

    ``blocking``: `post` waits for the result at once; else it is waited for by the next `take`
    (NOTE [Deferred exchanges]).
    """

    def __init__(self, group: dist.ProcessGroup | None, *, blocking: bool) -> None:
        self.group = group
        self.blocking = blocking
        self._pending: _Gathered | None = None

    @property
    def rank(self) -> int:
        """This rank's index in the gathered lists."""
        return dist.get_rank(self.group) if self.group is not None else 0

    def take(self) -> list[int] | None:
        """The result of the last post not taken yet (waiting for it), or None."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.wait()

    def post(self, value: int) -> list[int] | None:
        """Issue this rank's ``value``; return the values of this post (blocking) or of the previous one (deferred)."""
        previous = None if self.blocking else self.take()
        self._pending = _Gathered(int(value), self.group)
        return self.take() if self.blocking else previous
