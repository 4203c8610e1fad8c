"""Finer layer groups where a device budget is out of reach of the current ones.

NOTE [Budget splits layer groups]
Under bounded layer groups (the default, NOTE [Bounded layer groups] in core/marks.py) the lowest
peak a device budget can reach still holds whole groups: the one in use and the one being copied
or reloaded, two layers' worth where a layer's modules share one group (on one NVIDIA H200,
hidden 1024, the five modules of issue 26: 28 MiB of saved bytes at the lowest, against 10 MiB with
module groups and about 12 MiB for megatron's built-in, so a budget at megatron's peak fell 16 MiB
short). So a rank whose explicit budget the choice finds out of reach while its engine joins a
layer's calls under a bound above 0 does not warn: it lowers the bound (`OffloadManager.regroup`)
and chooses again from the next iteration's record, made with the finer groups. The bound drops to
a quarter of the largest group the record saved, or to 0 (no call joins but registered joiners:
module groups) where that is no lower; only a budget out of reach at 0 warns
(`budget_shortfall_message`). The iteration after each step offloads every group: group indices
change, so no choice made of the coarser groups applies. Numerics never change (a grouping decides
when bytes move, not what is computed), and ranks decide alone: the bound is no collective's input.
A budget of 'auto' levels the pipeline at its ranks' lowest peaks, which each rank reaches: it
never splits.
"""

from __future__ import annotations

from ..core import IterationRecord, OffloadConfig

__all__ = ["can_split", "split_bound"]


def can_split(config: OffloadConfig, device_budget: int | str | None) -> bool:
    """Whether a rank whose engine runs with ``config`` splits its layer groups rather than warn
    when ``device_budget`` is out of reach (NOTE [Budget splits layer groups])."""
    return isinstance(device_budget, int) and config.group_by == "layer" and config.layer_group_bytes != 0


def split_bound(bound: int | None, record: IterationRecord) -> int:
    """The lower bound of layer groups after ``record``'s groups could not reach the budget under
    ``bound`` (None: whole layers): a quarter of its largest group, or 0 where that is no lower."""
    largest = max((nbytes for sizes in record.group_bytes.values() for nbytes in sizes), default=0)
    quarter = largest // 4
    return quarter if quarter > 0 and (bound is None or quarter < bound) else 0
