"""The search behind `choose_offload` (NOTE [Budget choice] in budget.py)."""

from __future__ import annotations

from typing import Mapping, Sequence

from .plan import Plan
from .plan_policy import PlanPolicy
from .simulate import simulate

__all__ = ["search_offload"]

Chunk = tuple[int, int]


def search_offload(
    plan: Plan,
    sizes: Mapping[Chunk, Sequence[int]],
    target: int,
    *,
    prefetch_bytes: int | None,
    reload_ahead_bytes: int | None,
    slack: Mapping[Chunk, Sequence[float]],
) -> dict[Chunk, frozenset[int]]:
    """Groups to copy so that the predicted peak is at most ``target`` (reachable), few bytes."""

    def peak(chosen: set[tuple[Chunk, int]]) -> int:
        groups: dict[Chunk, set[int]] = {}
        for chunk, g in chosen:
            groups.setdefault(chunk, set()).add(g)
        policy = PlanPolicy(plan, prefetch_bytes=prefetch_bytes, reload_ahead_bytes=reload_ahead_bytes, offload_groups=groups)
        return simulate(plan, sizes, policy=policy).peak_resident_bytes

    order = {chunk: i for i, chunk in enumerate(plan.chunks)}
    candidates = sorted(
        ((chunk, g) for chunk, bs in sizes.items() for g, b in enumerate(bs) if b > 0),
        key=lambda cg: (slack[cg[0]][cg[1]] < 0, -sizes[cg[0]][cg[1]], order[cg[0]], cg[1]),
    )
    chosen: set[tuple[Chunk, int]] = set()
    for candidate in candidates:
        if peak(chosen) <= target:
            break
        chosen.add(candidate)
    for candidate in sorted(chosen, key=lambda cg: (-sizes[cg[0]][cg[1]], order[cg[0]], cg[1])):
        chosen.discard(candidate)
        if peak(chosen) > target:
            chosen.add(candidate)
    out: dict[Chunk, set[int]] = {}
    for chunk, g in chosen:
        out.setdefault(chunk, set()).add(g)
    return {chunk: frozenset(groups) for chunk, groups in sorted(out.items())}
