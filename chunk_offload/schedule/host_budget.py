"""A node's host-memory budget split among its ranks by what each rank's plan needs on host.

The ranks of a node share one host. Each rank's plan puts a different number of bytes on host
at its peak (early pipeline stages hold more microbatches in flight), so an even split starves
the first stages while the last ones leave theirs unused. `split_host_budget` gives each rank a
share of the node's budget in proportion to its need; the shares become the ranks' host pool
caps (`OffloadConfig(host_pool_bytes=...)`). `all_gather_host_needs` is the one collective that
brings every rank's need to every rank of the node, and `node_host_cap` chains both.

NOTE [Host budget split]
- Shares are proportional to the needs: cap_i = budget * need_i / sum(needs), so a budget above
  the total need leaves every rank headroom in the same ratio (the pool uses it under changing
  shapes), and a budget below it cuts every rank by the same fraction.
- Caps are whole ``unit``s (the pool's 512-byte rounding): each share is rounded down, then the
  units left over go one each to the ranks with the largest remainders (ties: lowest rank), so
  the caps sum to the budget rounded down to a unit, never above it.
- A rank that needs nothing gets 0: its plan offloads nothing, so its pool allocates nothing. If
  no rank needs anything, every cap is 0.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import torch
import torch.distributed as dist

from chunk_offload.core.errors import ChunkOffloadError

__all__ = ["all_gather_host_needs", "node_host_cap", "split_host_budget"]

_UNIT = 512


def _check_bytes(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ChunkOffloadError(f"{name} must be an int number of bytes >= 0, got {value!r}; pass e.g. 64 << 30 for 64 GiB")
    return int(value)


def split_host_budget(node_budget_bytes: int, needs: Sequence[int], *, unit: int = _UNIT) -> list[int]:
    """Per-rank host caps that share ``node_budget_bytes`` in proportion to ``needs`` (NOTE [Host budget split]).

    ``needs[i]``: bytes rank ``i`` of the node puts on host at its peak. Returns one cap per rank,
    each a multiple of ``unit``, summing to at most the budget.
    """
    budget = _check_bytes("node_budget_bytes", node_budget_bytes)
    if isinstance(needs, (str, bytes)) or not isinstance(needs, Sequence) or not needs:
        raise ChunkOffloadError(f"needs must be a non-empty sequence of byte counts, one per rank of the node, got {needs!r}")
    needs = [_check_bytes(f"needs[{i}]", need) for i, need in enumerate(needs)]
    if isinstance(unit, bool) or not isinstance(unit, numbers.Integral) or unit < 1:
        raise ChunkOffloadError(f"unit must be an int >= 1, got {unit!r}")
    total = sum(needs)
    if total == 0:
        return [0] * len(needs)
    units = budget // unit
    # Exact integer shares of the budget's units: quotient and remainder of units * need / total.
    shares = [divmod(units * need, total) for need in needs]
    caps = [q for q, _ in shares]
    left = units - sum(caps)
    by_remainder = sorted(range(len(needs)), key=lambda i: (-shares[i][1], i))
    for i in by_remainder[:left]:
        caps[i] += 1
    return [c * unit for c in caps]


def all_gather_host_needs(need_bytes: int, *, group: dist.ProcessGroup | None = None) -> list[int]:
    """COLLECTIVE over ``group`` (the ranks of one node): every rank's need, in group rank order.

    Every rank of ``group`` must call it with its own need. ``group`` is the node's process
    group, e.g. from ``torch.distributed.new_subgroups(group_size=ranks_per_node)``; ``None``
    is the default group (a single-node run).
    """
    need = _check_bytes("need_bytes", need_bytes)
    if not dist.is_available() or not dist.is_initialized():
        raise ChunkOffloadError("all_gather_host_needs needs torch.distributed initialized (init_process_group)")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor([need], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [int(t.item()) for t in gathered]


def node_host_cap(node_budget_bytes: int, need_bytes: int, *, group: dist.ProcessGroup | None = None) -> tuple[int, list[int], list[int]]:
    """COLLECTIVE over ``group``: this rank's cap, with every rank's need and cap (for the report).

    Returns ``(cap, needs, caps)``; all ranks compute the same split from the same gathered needs.
    """
    _check_bytes("node_budget_bytes", node_budget_bytes)  # before the collective: every rank fails alike
    needs = all_gather_host_needs(need_bytes, group=group)
    caps = split_host_budget(node_budget_bytes, needs)
    return caps[dist.get_rank(group)], needs, caps
