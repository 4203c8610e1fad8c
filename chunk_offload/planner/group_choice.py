"""Per stage, the groups to offload for a device budget, chosen before launch as at run time.

`choose_groups` feeds each stage's predicted bytes per offload group (`StageEstimate.group_bytes`
and, held elsewhere, ``group_kept_bytes``, equal to the measured ones on CPU) and its plan to
`chunk_offload.schedule.choose_offload`, the function the integrations call on the baseline
iteration's measured bytes, so ``chunk-offload plan --budget-gb`` shows the choice training will
make (before any copy is timed: no `CopyTiming`, the default prefetch). The budget is the stage's activation budget:
what the offload groups may keep resident is the budget less the stage's other activations at
its peak (``peak_without_offload_bytes - peak_saved_bytes``: every saved activation that is not
an offload group's, plus ``other_activation_bytes``), as the integrations take the device
peak's part that is not the groups'.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import ChunkOffloadError
from ..schedule import OffloadChoice, choose_offload
from .estimate import StageEstimate, StagePlanner

__all__ = ["GroupChoice", "choose_groups"]


@dataclass(kw_only=True)
class GroupChoice:
    """The per-group choice for one stage."""

    pp_rank: int
    budget_bytes: int
    """The stage's activation budget."""
    other_bytes: int
    """The stage's activations at its peak that are not offload groups' (estimate)."""
    choice: OffloadChoice
    """`choose_offload`'s result for the groups' budget, ``max(budget_bytes - other_bytes, 0)``."""
    groups_total: int
    """Offload groups of the iteration (every chunk), empty ones included."""
    by_module: dict[str, int]
    """Module name -> groups chosen of that module, over the iteration."""
    min_offload_bytes: int = 0
    """The planner's minimum size of an offloaded tensor (for the reason a stage cannot fit)."""

    @property
    def fits(self) -> bool:
        """Whether the stage's peak with the choice is within the budget: the groups' part fits
        what the stage's other activations leave, and those alone fit."""
        return self.choice.fits and self.other_bytes <= self.budget_bytes

    @property
    def over_bytes(self) -> int:
        """Bytes by which the lowest peak any choice reaches exceeds the budget (0 when it fits)."""
        return 0 if self.fits else max(0, self.other_bytes + self.choice.lowest_peak_bytes - self.budget_bytes)

    @property
    def reason(self) -> str | None:
        """Why the stage cannot fit the budget (None when it fits)."""
        if self.fits:
            return None
        if self.choice.baseline_peak_bytes == 0:
            return (
                f"nothing can be offloaded (no saved tensor of the offload modules reaches the minimum offload size, "
                f"{self.min_offload_bytes} B), and the stage's other activations alone take {_gb(self.other_bytes)}"
            )
        if self.other_bytes > self.budget_bytes:
            return (
                f"the activations offload does not move (other modules', tensors below {self.min_offload_bytes} B, "
                f"held elsewhere, other activations) alone take {_gb(self.other_bytes)}"
            )
        return f"offloading every group still leaves a peak of {_gb(self.other_bytes + self.choice.lowest_peak_bytes)}"

    @property
    def peak_with_offload_bytes(self) -> int:
        """Estimated stage activation peak with the choice (as `StageEstimate.peak_with_offload_bytes`)."""
        return self.other_bytes + self.choice.predicted_peak_bytes

    def describe(self) -> str:
        """One line for the text report."""
        c = self.choice
        head = f"stage {self.pp_rank}: "
        if not c.offloaded and self.fits:
            return head + f"offload no group: peak {_gb(self.peak_with_offload_bytes)} <= budget {_gb(self.budget_bytes)}"
        if not c.offloaded:
            return head + (
                f"does not fit: peak {_gb(self.peak_with_offload_bytes)} > budget {_gb(self.budget_bytes)}, "
                f"{_gb(self.over_bytes)} over: {self.reason}"
            )
        modules = ", ".join(f"{name} {n}" for name, n in self.by_module.items())
        chunks = len(c.offloaded)
        line = (
            f"offload {c.groups_offloaded} of {self.groups_total} groups in {chunks} chunks ({modules}); "
            f"peak {_gb(self.peak_with_offload_bytes)} {'<=' if self.fits else '>'} budget {_gb(self.budget_bytes)}, "
            f"copies {_gb(c.bytes_offloaded)} per iteration"
        )
        if not self.fits:
            line += (
                f"; does not fit: the lowest peak is {_gb(self.other_bytes + c.lowest_peak_bytes)}, "
                f"{_gb(self.over_bytes)} over: {self.reason}"
            )
        return head + line

    def to_dict(self) -> dict:
        """Plain JSON-able values; ``offloaded`` maps ``"microbatch,vp_stage"`` to group indices."""
        c = self.choice
        return {
            "pp_rank": self.pp_rank,
            "budget_bytes": self.budget_bytes,
            "other_bytes": self.other_bytes,
            "group_budget_bytes": c.budget_bytes,
            "fits": self.fits,
            "over_bytes": self.over_bytes,
            "reason": self.reason,
            "groups_offloaded": c.groups_offloaded,
            "groups_total": self.groups_total,
            "by_module": self.by_module,
            "bytes_offloaded": c.bytes_offloaded,
            "predicted_peak_bytes": c.predicted_peak_bytes,
            "baseline_peak_bytes": c.baseline_peak_bytes,
            "lowest_peak_bytes": c.lowest_peak_bytes,
            "peak_with_offload_bytes": self.peak_with_offload_bytes,
            "offloaded": {f"{mb},{vp}": sorted(groups) for (mb, vp), groups in sorted(c.offloaded.items())},
        }


def _gb(nbytes: int | float) -> str:
    return f"{nbytes / 1e9:.3f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3f} MB"


def choose_groups(planner: StagePlanner, stages: list[StageEstimate], *, budget_bytes: int) -> list[GroupChoice]:
    """Per stage of ``stages`` (``planner.estimate(modules)``), the groups to copy so that the
    stage's estimated activation peak fits ``budget_bytes`` (see the module docstring)."""
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0:
        raise ChunkOffloadError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
    out = []
    for stage in stages:
        plan = planner.plans[stage.pp_rank]
        other = stage.peak_without_offload_bytes - stage.peak_saved_bytes
        choice = choose_offload(plan, stage.group_bytes, max(budget_bytes - other, 0), kept_bytes=stage.group_kept_bytes)
        names = {chunk: stage.group_names[chunk[1]] for chunk in plan.chunks}
        out.append(
            GroupChoice(
                pp_rank=stage.pp_rank,
                budget_bytes=budget_bytes,
                other_bytes=other,
                choice=choice,
                groups_total=sum(len(stage.group_bytes[vp]) for _, vp in plan.chunks),
                by_module=_in_layer_order(choice.offloaded_by_name(names), stage.group_names),
                min_offload_bytes=planner.min_offload_bytes,
            )
        )
    return out


def _in_layer_order(counts: dict[str, int], group_names: dict[int, list[str]]) -> dict[str, int]:
    order = {name: i for i, name in enumerate(dict.fromkeys(n for names in group_names.values() for n in names))}
    return {name: counts[name] for name in sorted(counts, key=lambda n: order.get(n, len(order)))}
