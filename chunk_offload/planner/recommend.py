"""Per stage, the cheapest offload module set that fits a memory budget without stalling.

`recommend` tries every subset of the candidate modules (2^n sets, n <= 8) that megatron-core's
rules allow (`chunk_offload.module_names.combination_problem`) on every stage with
`StagePlanner` and keeps, per stage, among the sets that

- fit: the estimated activation peak with offload (NOTE [Stage activation peak] in
  `estimate.py`, plus ``other_activation_bytes``) is at most the budget, and
- hide: on every layer of the stage the copy of what it offloads takes no longer than its
  forward compute (`Hardware`),

the one that copies the fewest bytes per iteration (then the fewest modules, then the order of
`OFFLOAD_MODULE_NAMES`). The empty set qualifies when the stage fits without offloading. When no set
qualifies, the result says so and names the best achievable: the lowest peak among the sets
whose copies hide, and the lowest peak of all.

The budget is one device's: with tensor parallelism, one tensor-parallel rank of the stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Sequence

from ..core.errors import ChunkOffloadError
from .estimate import StageEstimate, StagePlanner
from ..module_names import OFFLOAD_MODULE_NAMES, canonical_modules, combination_problem

__all__ = ["Recommendation", "recommend"]

_MAX_CANDIDATES = 8


@dataclass(kw_only=True)
class Recommendation:
    """The choice for one stage."""

    pp_rank: int
    budget_bytes: int
    choice: StageEstimate | None
    """The cheapest qualifying set's estimate; None when no set fits without stalls."""
    best_hiding: StageEstimate | None
    """When none qualifies: the lowest peak among sets whose copies hide (None if none hides)."""
    lowest_peak: StageEstimate
    """The lowest peak of all sets tried (offloading everything, usually)."""

    @property
    def fits(self) -> bool:
        return self.choice is not None

    @property
    def modules(self) -> list[str] | None:
        return None if self.choice is None else list(self.choice.modules)

    def describe(self) -> str:
        """One line for the text report."""
        if self.choice is not None:
            names = ",".join(self.choice.modules) or "(none: fits without offload)"
            return (
                f"stage {self.pp_rank}: offload {names}; peak {_gb(self.choice.peak_with_offload_bytes)} "
                f"<= budget {_gb(self.budget_bytes)}, copies {_gb(self.choice.bytes_offloaded)} per iteration, hidden"
            )
        parts = [f"stage {self.pp_rank}: no module set fits {_gb(self.budget_bytes)} without stalls"]
        if self.best_hiding is not None:
            parts.append(
                f"best without stalls: {','.join(self.best_hiding.modules) or '(none)'} "
                f"at {_gb(self.best_hiding.peak_with_offload_bytes)}"
            )
        low = self.lowest_peak
        parts.append(
            f"lowest peak: {','.join(low.modules) or '(none)'} at {_gb(low.peak_with_offload_bytes)}"
            + ("" if low.hides else " (copies do not hide)")
        )
        return "; ".join(parts)

    def to_dict(self) -> dict:
        def brief(e: StageEstimate | None):
            if e is None:
                return None
            return {
                "modules": e.modules,
                "peak_with_offload_bytes": e.peak_with_offload_bytes,
                "bytes_offloaded": e.bytes_offloaded,
                "hides": e.hides,
            }

        return {
            "pp_rank": self.pp_rank,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "choice": brief(self.choice),
            "best_hiding": brief(self.best_hiding),
            "lowest_peak": brief(self.lowest_peak),
        }


def _gb(nbytes: int | float) -> str:
    return f"{nbytes / 1e9:.3f} GB"


def recommend(planner: StagePlanner, *, budget_bytes: int, candidates: str | Sequence[str] | None = None) -> list[Recommendation]:
    """Per stage of ``planner``, the cheapest candidate subset that fits ``budget_bytes`` and hides.

    ``candidates``: module names to choose from; None for every name the model has except
    ``moe_act`` (which the local layer spec does not have and the byte model only estimates).
    """
    if not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ChunkOffloadError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
    if candidates is None:
        present = {m for layers in planner.layers for chunk in layers for layer in chunk for m in planner.dims.modules_of(layer)}
        names = [m for m in OFFLOAD_MODULE_NAMES if m in present and m != "moe_act"]
    else:
        names = canonical_modules(candidates)
    if len(names) > _MAX_CANDIDATES:
        raise ChunkOffloadError(f"at most {_MAX_CANDIDATES} candidate modules (2^n sets are tried), got {len(names)}: {names}")
    subsets = [list(c) for k in range(len(names) + 1) for c in combinations(names, k) if combination_problem(c) is None]
    per_stage: list[list[StageEstimate]] = [[] for _ in range(planner.pipeline.pipeline_parallel)]
    for subset in subsets:
        estimates = planner.estimate(subset)
        for r, estimate in enumerate(estimates):
            per_stage[r].append(estimate)
    out = []
    for r, estimates in enumerate(per_stage):
        qualifying = [e for e in estimates if e.hides and e.peak_with_offload_bytes <= budget_bytes]
        choice = min(qualifying, key=lambda e: (e.bytes_offloaded, len(e.modules)), default=None)
        hiding = [e for e in estimates if e.hides]
        best_hiding = None if choice is not None else min(hiding, key=lambda e: e.peak_with_offload_bytes, default=None)
        lowest = min(estimates, key=lambda e: (e.peak_with_offload_bytes, e.bytes_offloaded))
        out.append(Recommendation(pp_rank=r, budget_bytes=budget_bytes, choice=choice, best_hiding=best_hiding, lowest_peak=lowest))
    return out
