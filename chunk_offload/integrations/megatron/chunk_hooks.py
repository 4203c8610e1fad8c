"""`ChunkHooks`: the forward hooks on a rank's Megatron model chunks that open and close chunk scopes.

Megatron's schedules run the forwards of one model chunk in microbatch order, so each chunk's
forward pre-hook tells the `TrainingSession` that the chunk (microbatch, vp_stage) starts, the
microbatch being the number of training forwards that chunk already ran in this iteration, and
its forward hook that it ended; the session records the order the chunks really ran (an F at
each forward, a B when the gradient of the chunk's output arrives). With ``iterations="auto"``
the hooks give `auto.AutoIterations` its cues (NOTE [Automatic iterations]).

Whether a chunk forward trains is the session's rule (`TrainingSession.is_training_pass`, NOTE
[Forward-only passes] in ``session.py``); any other forward is left alone (in auto mode it may
only close a complete iteration). A training forward outside any iteration offloads nothing; the
hooks then warn once, naming both ways to open iterations.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from ..session import TrainingSession
    from .auto import AutoIterations

__all__ = ["ChunkHooks"]

logger = logging.getLogger(__name__)


class ChunkHooks:
    """The forward pre-hook and forward hook of each model chunk of one rank, and what they count.

    ``chunks[v]`` is virtual stage ``v``; ``auto``: the manager's `AutoIterations` with
    ``iterations="auto"``, else None (then the hooks act only inside the engine's iterations).
    """

    def __init__(self, session: TrainingSession, chunks: Sequence[nn.Module], auto: AutoIterations | None) -> None:
        self._session = session
        self._auto = auto
        self.forwards = [0] * len(chunks)
        """Training forwards each model chunk ran in the open iteration (the next one's microbatch)."""
        self._open_chunks: list[bool] = []  # per chunk forward whose pre-hook ran: did it begin a chunk scope?
        self._warned_outside_iteration = False
        self._handles: list[RemovableHandle] = []
        for vp_stage, chunk in enumerate(chunks):
            self._handles.append(chunk.register_forward_pre_hook(_ChunkHook(self._make_pre(vp_stage))))
            self._handles.append(chunk.register_forward_hook(_ChunkHook(self._make_post(vp_stage)), always_call=True))

    def new_iteration(self) -> None:
        """Count each chunk's forwards from microbatch 0 again."""
        self.forwards = [0] * len(self.forwards)

    def remove(self) -> None:
        """Remove the hooks from the model chunks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _make_pre(self, vp_stage: int) -> Callable:
        def pre(module: nn.Module, args: tuple) -> None:
            training = self._session.is_training_pass()  # NOTE [Forward-only passes]
            if self._auto is not None:
                self._auto.before_forward(vp_stage, training)  # opens the iteration of a training forward
            elif training and not self._session.engine.in_iteration:
                self._warn_outside_iteration(vp_stage)
                return
            if not training:
                return
            microbatch = self.forwards[vp_stage]
            self.forwards[vp_stage] += 1
            self._session.chunk_forward_started(microbatch=microbatch, vp_stage=vp_stage)
            self._open_chunks.append(True)

        return pre

    def _make_post(self, vp_stage: int) -> Callable:
        def post(module: nn.Module, args: tuple, output: Any) -> Any:
            if not self._open_chunks:
                return None
            self._open_chunks.pop()
            failed = sys.exc_info()[0] is not None  # inside torch's except clause when the forward raised
            key = self._session.chunk_forward_ended(abort=failed)
            if failed and self._auto is not None and self._auto.is_open:
                # The step is broken: free what its earlier chunks hold now, not when someone
                # calls end_iteration(discard=True); the next training forward opens a fresh one.
                logger.warning("chunk_offload: a forward of model chunk %d raised; discarding the open iteration.", vp_stage)
                self._auto.close(discard=True)
                return None
            if key is not None and output is not None:
                # Bound to this iteration's order and state, even if the gradient arrives after it closed.
                callbacks = [self._session.backward_recorder(microbatch=key.microbatch, vp_stage=vp_stage)]

                def backward_began() -> None:
                    for callback in callbacks:
                        callback()

                if _on_backward(output, backward_began) and self._auto is not None:
                    arrived = self._auto.backward_pending()
                    if arrived is not None:
                        callbacks.append(arrived)
            return None

        return post

    def _warn_outside_iteration(self, vp_stage: int) -> None:
        if self._warned_outside_iteration:
            return
        self._warned_outside_iteration = True
        warnings.warn(
            f"chunk_offload: a training forward (gradients enabled) of model chunk {vp_stage} ran outside any offload "
            "iteration, so nothing it saves is offloaded. Run training through "
            "manager.wrap(get_forward_backward_func()), or, when the training loop calls get_forward_backward_func() "
            "itself (Megatron-LM's pretrain), attach with iterations='auto' (--chunk-offload-iterations auto). "
            "A forward-only pass (forward_only=True, evaluation) is not training: run it under torch.no_grad(), "
            "through the wrapped function or inside manager.forward_only(). Shown once per manager.",
            RuntimeWarning,
            stacklevel=3,
        )


class _ChunkHook:
    """A chunk's forward hook. A pickled or deep-copied model chunk gets a hook that does nothing in
    its place: the copy belongs to no manager (as a copied `ModuleOffload` in core/marks.py), and
    the manager's session (threads, streams) is not part of the model's state."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self._function = function

    def __call__(self, *args: Any) -> Any:
        return self._function(*args)

    def __reduce__(self) -> tuple:
        return (_DetachedHook, ())


class _DetachedHook:
    """What a copied `_ChunkHook` becomes: nothing happens at the copy's forwards."""

    def __call__(self, *args: Any) -> None:
        return None


def _on_backward(output: Any, callback: Callable[[], None]) -> bool:
    """Call ``callback`` once when the gradient of the chunk's output tensor is computed; False if it never can be."""
    tensor = output if isinstance(output, torch.Tensor) else None
    if tensor is None and isinstance(output, (tuple, list)):
        tensor = next((t for t in output if isinstance(t, torch.Tensor)), None)
    if tensor is None or not tensor.requires_grad:
        return False
    fired = []

    def hook(grad: torch.Tensor) -> None:
        if not fired:
            fired.append(True)
            callback()

    tensor.register_hook(hook)
    return True
