"""The plan: one pipeline rank's ordered actions for one iteration, as data.

Each `chunk_offload.core.Action` is one forward (``F``), backward (``B``; under zero-bubble
schedules only the input-gradient part) or weight-gradient step (``W``) of one (microbatch,
virtual stage) chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ..core.actions import Action, ActionKind, diff_actions, format_actions
from ..core.errors import ChunkOffloadError

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """The actions of one rank for one iteration, in the order they run.

    Every chunk has exactly one ``F`` and one ``B`` (``B`` after ``F``), at most one ``W``
    (after its ``B``); chunks of one virtual stage run forward in microbatch order.
    """

    actions: tuple[Action, ...]
    pp_rank: int = 0
    pp_size: int = 1
    vp_size: int = 1
    source: str = ""
    """Where the plan came from (``"megatron 1F1B"``, ``"observed"``, ...), for messages."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(Action.of(a) for a in self.actions))
        self.validate()

    @classmethod
    def from_order(cls, order: Iterable[Action | tuple | str], **fields) -> "Plan":
        """A plan from ``(kind, microbatch, vp_stage)`` tuples or compact strings."""
        return cls(tuple(order), **fields)

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise `ChunkOffloadError` naming the first action that breaks a rule of the class doc."""
        seen: dict[tuple[ActionKind, tuple[int, int]], int] = {}
        next_forward: dict[int, int] = {}
        for i, action in enumerate(self.actions):
            if action.microbatch < 0 or not 0 <= action.vp_stage < self.vp_size:
                self._fail(i, f"microbatch must be >= 0 and vp_stage in [0, {self.vp_size})")
            key = (action.kind, action.chunk)
            if key in seen:
                self._fail(i, f"{action} appears twice (first at step {seen[key]})")
            seen[key] = i
            if action.kind is ActionKind.FORWARD:
                expected = next_forward.get(action.vp_stage, 0)
                if action.microbatch != expected:
                    self._fail(i, f"virtual stage {action.vp_stage} runs forwards in microbatch order: expected microbatch {expected}")
                next_forward[action.vp_stage] = expected + 1
            elif action.kind is ActionKind.BACKWARD and (ActionKind.FORWARD, action.chunk) not in seen:
                self._fail(i, f"{action} runs before its forward")
            elif action.kind is ActionKind.WEIGHT and (ActionKind.BACKWARD, action.chunk) not in seen:
                self._fail(i, f"{action} runs before its backward")
        missing = [f"{vp}B{mb}" for kind, (mb, vp) in seen if kind is ActionKind.FORWARD and (ActionKind.BACKWARD, (mb, vp)) not in seen]
        if missing:
            raise ChunkOffloadError(f"{self._name} has forwards without a backward: {missing}\n{self.format()}")

    @property
    def _name(self) -> str:
        return f"plan ({self.source})" if self.source else "plan"

    def _fail(self, step: int, why: str) -> None:
        raise ChunkOffloadError(f"invalid {self._name}: step {step} ({self.actions[step]}): {why}\n{self.format(mark=step)}")

    # ------------------------------------------------------------------ queries
    @property
    def chunks(self) -> list[tuple[int, int]]:
        """(microbatch, vp_stage) of every chunk, in forward order."""
        return [a.chunk for a in self.actions if a.kind is ActionKind.FORWARD]

    @property
    def has_weight_steps(self) -> bool:
        return any(a.kind is ActionKind.WEIGHT for a in self.actions)

    def index(self, kind: ActionKind | str, microbatch: int, vp_stage: int) -> int:
        """Step number of one action."""
        return self.actions.index(Action(ActionKind(kind), microbatch, vp_stage))

    def lifespan(self, microbatch: int, vp_stage: int) -> int:
        """Actions that run between the chunk's forward and its backward (0: backward follows at once)."""
        return self.index(ActionKind.BACKWARD, microbatch, vp_stage) - self.index(ActionKind.FORWARD, microbatch, vp_stage) - 1

    def in_flight(self) -> list[int]:
        """Chunks whose forward ran and whose saved tensors are still needed, after each action."""
        release = ActionKind.WEIGHT if self.has_weight_steps else ActionKind.BACKWARD
        has_w = {a.chunk for a in self.actions if a.kind is ActionKind.WEIGHT}
        alive, out = 0, []
        for action in self.actions:
            if action.kind is ActionKind.FORWARD:
                alive += 1
            elif action.kind is release or (action.kind is ActionKind.BACKWARD and action.chunk not in has_w):
                alive -= 1
            out.append(alive)
        return out

    def diff(self, observed: Sequence[Action | tuple | str]) -> str | None:
        """None when ``observed`` is this plan; else a description of the first difference."""
        return diff_actions(self.actions, [Action.of(a) for a in observed], name=self._name)

    # ------------------------------------------------------------------ display
    def format(self, *, mark: int | None = None) -> str:
        """The actions in one line, ``[...]`` around step ``mark``."""
        return format_actions(self.actions, mark=mark)


    def __str__(self) -> str:
        return f"Plan({self.source}, pp_rank={self.pp_rank}/{self.pp_size}, vp={self.vp_size}: {self.format()})"
