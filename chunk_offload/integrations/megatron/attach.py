"""`attach`: offload chosen submodules of megatron-core GPTModel chunks under Megatron's schedules.

Nothing in Megatron is patched. Module hooks do all the work:

- each offloaded submodule (see `modules.py`) becomes one group per call;
- each model chunk's forward opens the chunk handler for (microbatch, vp_stage): Megatron's
  schedules run the forwards of one model chunk in microbatch order, so the microbatch is the
  number of forwards that chunk already ran in this iteration;
- `MegatronOffloadManager.wrap(forward_backward_func)` makes each call one iteration, and runs a
  ``forward_only=True`` call (evaluation) without offload, leaving the training state untouched.

The order in which chunks ran forward and backward is recorded per iteration
(`observed_order`), so schedule-driven decisions can be checked against what really ran.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ...core.errors import ChunkOffloadError
from ...core.manager import OffloadManager
from .modules import canonical_names, resolve

__all__ = ["MegatronOffloadManager", "attach"]

logger = logging.getLogger(__name__)

_MISSING_HINTS = {
    "attn_norm": "with the Transformer Engine spec the attention norm is fused into linear_qkv: offload qkv_linear",
    "mlp_norm": "with the Transformer Engine spec the MLP norm is fused into linear_fc1: offload mlp_fc1/expert_fc1",
    "mlp_fc1": "MoE layers have no dense MLP: offload expert_fc1",
    "expert_fc1": "dense layers have no experts, and GroupedMLP has no fc1 module: use SequentialMLP or TEGroupedMLP",
    "moe_act": "the expert activation is a plain function in this model, not a module",
}


class MegatronOffloadManager(OffloadManager):
    """An `OffloadManager` bound to the model chunks of one pipeline rank."""

    def __init__(self, model_chunks: nn.Module | Sequence[nn.Module], offload_modules: str | Sequence[str], **options: Any) -> None:
        offload_modules = canonical_names(offload_modules)  # fail before the streams start
        super().__init__(**options)
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
            raise ChunkOffloadError(
                f"attach expects a GPTModel chunk or a list of them (one per virtual stage), got {model_chunks!r:.200}"
            )
        self.model_chunks = chunks
        self.offload_modules = offload_modules
        self.registered: dict[str, int] = {}
        for chunk in chunks:
            self.protect_module(chunk)
            for name in self.offload_modules:
                for module in resolve(chunk, name):
                    self.offload_module(module, name)
                    self.registered[name] = self.registered.get(name, 0) + 1
        for name in self.offload_modules:
            if name not in self.registered:
                logger.warning(
                    "chunk_offload: offload module %r matches no submodule on this rank (%s); nothing of it is offloaded here.",
                    name,
                    _MISSING_HINTS.get(name, "not present in this model"),
                )
        self._forwards = [0] * len(chunks)
        self._chunk_scopes: list[contextlib.ExitStack] = []
        self._forward_only = False
        self.observed_order: list[tuple[str, int, int]] = []
        """The (F|B, microbatch, vp_stage) actions of the last training iteration, as they ran."""
        self._chunk_hooks = []
        for vp_stage, chunk in enumerate(chunks):
            self._chunk_hooks.append(chunk.register_forward_pre_hook(self._make_pre(vp_stage)))
            self._chunk_hooks.append(chunk.register_forward_hook(self._make_post(vp_stage), always_call=True))

    # ------------------------------------------------------------------ chunk scopes
    def _make_pre(self, vp_stage: int) -> Callable:
        def pre(module: nn.Module, args: tuple) -> None:
            if not self._in_iteration or self._forward_only:
                return
            microbatch = self._forwards[vp_stage]
            self._forwards[vp_stage] += 1
            scope = contextlib.ExitStack()
            handler = scope.enter_context(self.chunk(microbatch=microbatch, vp_stage=vp_stage))
            self._chunk_scopes.append(scope)
            if handler is not None:
                self.observed_order.append(("F", microbatch, vp_stage))

        return pre

    def _make_post(self, vp_stage: int) -> Callable:
        def post(module: nn.Module, args: tuple, output: Any) -> Any:
            if not self._chunk_scopes:
                return None
            scope = self._chunk_scopes.pop()
            handler = self.current_handler
            scope.__exit__(*sys.exc_info())  # inside torch's except clause when the forward raised
            if handler is not None and output is not None:
                return _on_backward(output, lambda: self.observed_order.append(("B", handler.key.microbatch, vp_stage)))
            return None

        return post

    # ------------------------------------------------------------------ iterations
    def wrap(self, forward_backward_func: Callable) -> Callable:
        """Return ``forward_backward_func`` with each training call run as one offload iteration."""

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("forward_only", False):
                previous, self._forward_only = self._forward_only, True
                try:
                    return forward_backward_func(*args, **kwargs)
                finally:
                    self._forward_only = previous
            self._forwards = [0] * len(self.model_chunks)
            self.observed_order = []
            with self.iteration():
                return forward_backward_func(*args, **kwargs)

        wrapped.__wrapped__ = forward_backward_func
        return wrapped

    def detach(self) -> None:
        """Remove every hook this manager installed on the model."""
        for handle in self._chunk_hooks:
            handle.remove()
        self._chunk_hooks = []
        for registration in self._registrations:
            registration.remove()
        self._registrations.clear()


def _on_backward(output: Any, callback: Callable[[], None]) -> Any:
    """Call ``callback`` once when the gradient of the chunk's output tensor is computed."""
    tensor = output if isinstance(output, torch.Tensor) else None
    if tensor is None and isinstance(output, (tuple, list)):
        tensor = next((t for t in output if isinstance(t, torch.Tensor)), None)
    if tensor is not None and tensor.requires_grad:
        fired = []

        def hook(grad: torch.Tensor) -> None:
            if not fired:
                fired.append(True)
                callback()

        tensor.register_hook(hook)
    return None


def attach(model_chunks: nn.Module | Sequence[nn.Module], offload_modules: str | Sequence[str], **options: Any) -> MegatronOffloadManager:
    """Offload ``offload_modules`` of megatron-core GPTModel ``model_chunks`` (one per virtual stage).

    ``offload_modules``: names from `chunk_offload.integrations.megatron.OFFLOAD_MODULE_NAMES`
    (a list or a comma-separated string). ``options``: `OffloadConfig` fields and ``streams``.
    Wrap Megatron's ``get_forward_backward_func()`` with the returned manager's `wrap`.
    """
    return MegatronOffloadManager(model_chunks, offload_modules, **options)
