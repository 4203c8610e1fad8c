"""Automatic iterations: the state machine that opens and closes iterations from chunk hooks.

Used by `MegatronOffloadManager` with ``iterations="auto"`` (for training loops that call
``get_forward_backward_func()`` themselves, like Megatron-LM's ``pretrain``).

NOTE [Automatic iterations]
With ``iterations="auto"`` no wrap is needed. The first training chunk forward (gradients
enabled, not inference mode, not inside ``manager.forward_only()``) while no iteration is open
opens one, for N microbatches: the ``num_microbatches`` int, the callable's value, or by default
Megatron's ``get_num_microbatches()`` (Megatron-LM's ``initialize_megatron`` sets that
calculator up; the count is read again for every iteration, so batch-size ramp-up is followed).
The iteration is complete when every model chunk of the rank ran N training forwards, the
gradient of every chunk output reached it (each chunk's backward began) and every chunk handler
released its saved tensors. A complete iteration is closed lazily, never from inside autograd's
backward: by the next chunk forward of any kind (a training forward then opens the next
iteration; a forward-only pass opens nothing and offloads nothing, NOTE [Forward-only passes] in
``session.py``), by `end_iteration`, `report`, `detach` or `close`. Closing does what `wrap`
does after a call: count the training call, keep its record, check the plan. A chunk forward
that raises discards the open iteration at once (its chunks' saved tensors are freed; the next
training forward opens a fresh one); an exception in backward leaves it open, and
`end_iteration(discard=True)` or `close` frees it. A training forward of a chunk that already
ran N forwards in an incomplete iteration cannot belong to that iteration nor start the next
one: it raises, with the counts. `wrap` and `iteration` are refused in this mode (one owner of
the iterations).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

from ...core import ChunkOffloadError, OffloadManager, option

__all__ = ["ITERATION_MODES", "AutoIterations", "IterationOwner", "check_iterations"]

logger = logging.getLogger(__name__)

ITERATION_MODES = option("attach.iterations").choices
"""How training iterations are delimited: by ``manager.wrap(forward_backward_func)`` calls, or
by the chunk hooks themselves (NOTE [Automatic iterations])."""


class IterationOwner(Protocol):
    """What `AutoIterations` drives: the `MegatronOffloadManager` it belongs to."""

    engine: OffloadManager

    @property
    def forwards(self) -> list[int]: ...

    def prepare_plan(self, num_microbatches: int | None) -> None: ...

    def begin_training_iteration(self) -> None: ...

    def end_training_iteration(self, *, discard: bool = False) -> None: ...


@dataclass(slots=True)
class _Open:
    """The iteration auto mode opened: its microbatch count and its backwards to come."""

    num_microbatches: int
    pending_backwards: int = 0
    """Chunk outputs whose gradient has not arrived yet (their chunk's backward has not begun)."""


class AutoIterations:
    """Opens an iteration at the first training chunk forward and closes it once complete."""

    def __init__(self, manager: IterationOwner, num_microbatches: int | Callable[[], int] | None) -> None:
        self._manager = manager
        self._num_microbatches = num_microbatches
        self._open: _Open | None = None

    @property
    def is_open(self) -> bool:
        return self._open is not None

    def before_forward(self, vp_stage: int, training: bool) -> None:
        """Before a chunk forward: close a complete iteration, then open one for a training forward."""
        manager, current = self._manager, self._open
        forwards = manager.forwards
        if current is not None:
            if self.missing() is None:
                self.close()
            elif training and forwards[vp_stage] >= current.num_microbatches:
                raise ChunkOffloadError(
                    f"model chunk {vp_stage} starts training forward {forwards[vp_stage] + 1} of an iteration of "
                    f"num_microbatches={current.num_microbatches} (training forwards per model chunk so far: "
                    f"{forwards}), but that iteration is not complete ({self.missing()}). Set "
                    "attach(..., num_microbatches=...) to the number of microbatches of each forward_backward_func "
                    "call (an int, or a callable returning the current count); run "
                    "evaluation under torch.no_grad() or inside manager.forward_only() (a forward_only=True call "
                    "with gradients enabled looks like training); after a step that failed part-way, call "
                    "manager.end_iteration(discard=True)."
                )
        if training and self._open is None:
            num_microbatches = self._current_num_microbatches()
            manager.prepare_plan(num_microbatches)
            manager.begin_training_iteration()
            self._open = _Open(num_microbatches)

    def backward_pending(self) -> Callable[[], None] | None:
        """Count one chunk output whose gradient is awaited; returns what to call when it arrives."""
        current = self._open
        if current is None:
            return None
        current.pending_backwards += 1

        def arrived() -> None:
            current.pending_backwards -= 1

        return arrived

    def _current_num_microbatches(self) -> int:
        source = self._num_microbatches
        if source is None:
            from megatron.core import num_microbatches_calculator

            try:
                value = num_microbatches_calculator.get_num_microbatches()
            except AttributeError as e:  # megatron-core's global calculator is None until initialised
                raise ChunkOffloadError(
                    "iterations='auto' without num_microbatches reads megatron.core.num_microbatches_calculator."
                    "get_num_microbatches(), but that calculator is not initialised (Megatron-LM's initialize_megatron "
                    "initialises it; megatron-core alone does not). Pass attach(..., num_microbatches=N), or a callable "
                    "returning the current count."
                ) from e
            what = "megatron.core.num_microbatches_calculator.get_num_microbatches()"
        elif callable(source):
            value, what = source(), f"the num_microbatches callable {source!r}"
        else:
            return source  # checked by check_iterations
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ChunkOffloadError(f"{what} returned {value!r}; the number of microbatches must be an int >= 1")
        return value

    def missing(self) -> str | None:
        """What the open iteration still lacks (None: it is complete)."""
        current = self._open
        n = current.num_microbatches
        forwards = self._manager.forwards
        missing = []
        if any(f != n for f in forwards):
            missing.append(f"training forwards per model chunk {forwards} of {n} each")
        if current.pending_backwards:
            missing.append(f"{current.pending_backwards} chunk backward(s) not begun")
        holding = sum(not h.released for h in self._manager.engine.iteration_handlers)
        if holding:
            missing.append(f"{holding} chunk(s) still holding saved tensors")
        return "; ".join(missing) or None

    def close(self, *, discard: bool = False) -> None:
        """Close the open iteration: as a training call, or discarded (no record, no call)."""
        self._open = None
        self._manager.end_training_iteration(discard=discard)

    def end_iteration(self, *, discard: bool = False) -> None:
        """`MegatronOffloadManager.end_iteration` in auto mode."""
        if self._open is None:
            return
        if not discard:
            missing = self.missing()
            if missing is not None:
                raise ChunkOffloadError(
                    f"end_iteration(): the open iteration of num_microbatches={self._open.num_microbatches} is not "
                    f"complete ({missing}); finish the step's forwards and backwards first, or call "
                    "end_iteration(discard=True) to drop it."
                )
        self.close(discard=discard)

    def settle(self, *, discard_incomplete: bool) -> None:
        """Close an open iteration if complete; else discard it (with a warning) or leave it open."""
        if self._open is None:
            return
        missing = self.missing()
        if missing is None:
            self.close()
        elif discard_incomplete:
            logger.warning("chunk_offload: discarding the open incomplete iteration (%s) at close().", missing)
            self.close(discard=True)


def check_iterations(iterations: object, num_microbatches: object) -> None:
    """Raise unless ``iterations`` is a mode of `ITERATION_MODES` and ``num_microbatches`` fits it."""
    if iterations not in ITERATION_MODES:
        raise ChunkOffloadError(
            f"iterations must be 'wrap' (each manager.wrap(forward_backward_func) call is one iteration) or 'auto' "
            f"(the chunk hooks delimit iterations, for Megatron-LM's own training loop), got {iterations!r}"
        )
    if num_microbatches is None:
        return
    if iterations == "wrap":
        raise ChunkOffloadError(
            f"num_microbatches={num_microbatches!r} applies to iterations='auto'; with iterations='wrap' each call's "
            "num_microbatches= keyword is used."
        )
    if callable(num_microbatches):
        return
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ChunkOffloadError(
            f"num_microbatches must be an int >= 1, a callable returning one, or None (Megatron's "
            f"get_num_microbatches()), got {num_microbatches!r}"
        )
