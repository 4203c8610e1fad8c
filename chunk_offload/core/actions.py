"""What runs on a rank, as data: a chunk (`ChunkKey`) and one step of it (`Action`).

The engine records the order chunks ran in as `Action`s (`IterationRecord.order`), the
integrations record the order their schedule ran as `Action`s, and a plan
(`chunk_offload.schedule.Plan`) is a checked tuple of them: one shape everywhere.
An `Action`'s compact form is ``<vp_stage><kind><microbatch>``, e.g. ``1F0`` or ``0B3``, as in
torch.distributed.pipelining's action strings.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Sequence

from .errors import ChunkOffloadError

__all__ = ["NOTATION", "Action", "ActionKind", "ChunkKey", "diff_actions", "format_actions"]

NOTATION = "notation: docs/glossary.md in chunk-offload's repository"
"""The line every printed table and action list of the package ends with: its abbreviations and
notations (``1F0``, ``0/2``, ``R``, ``peak w/o``, ...) are explained there, in one place."""


class ChunkKey(NamedTuple):
    """Which chunk: the microbatch and the virtual pipeline stage (model chunk) on this rank."""

    microbatch: int
    vp_stage: int

    def __str__(self) -> str:
        return f"(microbatch={self.microbatch}, vp_stage={self.vp_stage})"


class ActionKind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    """The whole backward, or its input-gradient part when a W step follows."""
    WEIGHT = "W"
    """Zero-bubble weight-gradient step: the saved tensors it needs live until it ran."""


class Action(NamedTuple):
    """One step of a rank: ``kind`` of chunk (``microbatch``, ``vp_stage``)."""

    kind: ActionKind
    microbatch: int
    vp_stage: int

    @property
    def chunk(self) -> tuple[int, int]:
        return (self.microbatch, self.vp_stage)

    def __str__(self) -> str:
        return f"{self.vp_stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """``"1F0"`` -> Action(F, microbatch=0, vp_stage=1)."""
        for kind in ActionKind:
            vp, sep, mb = text.partition(kind.value)
            if sep and vp.isdigit() and mb.isdigit():
                return cls(kind, int(mb), int(vp))
        raise ChunkOffloadError(f"cannot parse action {text!r}; expected <vp_stage><F|B|W><microbatch>, e.g. '1F0'")

    @classmethod
    def of(cls, item: "Action | tuple | str") -> "Action":
        """An `Action` from itself, a ``(kind, microbatch, vp_stage)`` tuple or a compact string."""
        if isinstance(item, str):
            return cls.parse(item)
        kind, microbatch, vp_stage = item
        return cls(ActionKind(kind), int(microbatch), int(vp_stage))


def format_actions(actions, *, mark: int | None = None) -> str:
    """The actions in one line, ``[...]`` around step ``mark``."""
    return " ".join(f"[{a}]" if i == mark else str(a) for i, a in enumerate(actions))


def diff_actions(expected: Sequence[Action], observed: Sequence[Action], *, name: str = "plan") -> str | None:
    """None when ``observed`` is ``expected``; else the first difference, both lists drawn side by side.

    ``name`` names ``expected`` in the message (``"plan"``, ``"listed"``, ...).
    """
    for step, (want, have) in enumerate(zip(expected, observed)):
        if want != have:
            return f"step {step}: {name} says {want}, observed {have}\n" + _side_by_side(expected, observed, step, name)
    if len(observed) != len(expected):
        step = min(len(observed), len(expected))
        return f"{name} has {len(expected)} actions, observed {len(observed)}\n" + _side_by_side(expected, observed, step, name)
    return None


def _side_by_side(expected: Sequence[Action], observed: Sequence[Action], mark: int, name: str) -> str:
    label = f"{name.split(' ')[0]}:"
    return (
        f"  {label:<9} {format_actions(expected, mark=mark)}\n  observed: {format_actions(observed, mark=mark)}\n"
        f"  (<vp_stage><F|B|W><microbatch>: 1F0 is the forward of microbatch 0 of virtual stage 1; [ ] marks step {mark}; "
        f"{NOTATION})"
    )
