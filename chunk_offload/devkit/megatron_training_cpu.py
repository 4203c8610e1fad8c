"""Run Megatron-LM's training package (``megatron.training``) on a CPU-only host with gloo.

`chunk_offload.devkit.cpu_compat` makes megatron-core build and train on CPU; Megatron-LM's own
``initialize_megatron`` / ``pretrain`` need a few more rules, each named, reversible and listed
in docs/megatron_cpu.md::

    from chunk_offload.devkit import cpu_compat, megatron_training_cpu

    with cpu_compat.megatron_on_cpu(), megatron_training_cpu.training_on_cpu() as rules:
        pretrain(...)                    # rules.applied names the rules in force

Inert when ``torch.cuda.is_available()``. The rules:

* ``allow_no_cuda``: ``initialize_megatron`` is called with ``allow_no_cuda=True`` (it asserts
  CUDA otherwise).
* ``device_count``: ``torch.cuda.device_count()`` is 1 and ``torch.cuda.set_device`` does
  nothing: with 0 devices ``_initialize_distributed`` silently skips model-parallel set-up and
  ``_set_random_seed`` skips ``model_parallel_cuda_manual_seed``.
* ``compile_helpers``: ``megatron.core.datasets.utils.compile_helpers`` imports the compiled
  ``helpers_cpp`` when it imports (the wheel ships it, and no Makefile) and runs Megatron's
  ``make`` only otherwise (a Megatron-LM checkout), after checking the tools it needs
  (`chunk_offload.devkit.megatron_dataset_helpers`).
* ``fused_kernels``: ``megatron.legacy.fused_kernels.load`` (core_v0.16's ``initialize``; only in
  a Megatron-LM checkout) does not build the nvcc kernels. Skipped where the module is absent.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .megatron_dataset_helpers import compiled_or_built

__all__ = ["RULES", "TrainingCpuRules", "enable", "training_on_cpu"]

RULES = ("allow_no_cuda", "device_count", "compile_helpers", "fused_kernels")
"""The rule names, in the order they are applied."""

_INITIALIZE_BINDINGS = ("megatron.training", "megatron.training.initialize", "megatron.training.training")


@dataclass(slots=True)
class _Patch:
    owner: Any
    name: str
    original: Any


class TrainingCpuRules:
    """The applied rules; ``disable()`` undoes them (idempotent). Built by `enable`."""

    def __init__(self) -> None:
        self._patches: list[_Patch] = []
        self.applied: list[str] = []
        """Names of the rules in force (a rule whose target is absent is not listed)."""

    @property
    def patched(self) -> tuple[str, ...]:
        """``module.attribute`` names currently replaced."""
        return tuple(f"{getattr(p.owner, '__name__', p.owner)}.{p.name}" for p in self._patches)

    def disable(self) -> None:
        """Put every patched attribute back, newest first."""
        for patch in reversed(self._patches):
            setattr(patch.owner, patch.name, patch.original)
        self._patches.clear()
        self.applied.clear()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patches.append(_Patch(owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    # -- the rules ----------------------------------------------------------------------------

    def _allow_no_cuda(self) -> bool:
        wrappers: dict[Any, Callable[..., Any]] = {}
        for module_name in _INITIALIZE_BINDINGS:
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # megatron-core < 0.19 without a Megatron-LM checkout
                return False
            original = module.__dict__.get("initialize_megatron")
            if original is None:
                continue
            wrapper = wrappers.get(original) or wrappers.setdefault(original, _with_allow_no_cuda(original))
            self._patch(module, "initialize_megatron", wrapper)
        return bool(wrappers)

    def _device_count(self) -> bool:
        self._patch(torch.cuda, "device_count", lambda: 1)
        self._patch(torch.cuda, "set_device", lambda device: None)
        return True

    def _compile_helpers(self) -> bool:
        utils = importlib.import_module("megatron.core.datasets.utils")
        self._patch(utils, "compile_helpers", compiled_or_built(utils.compile_helpers))
        return True

    def _fused_kernels(self) -> bool:
        try:
            fused_kernels = importlib.import_module("megatron.legacy.fused_kernels")
        except ImportError:
            return False
        self._patch(fused_kernels, "load", lambda args: None)
        return True


def _with_allow_no_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        bound.arguments["allow_no_cuda"] = True
        return original(*bound.args, **bound.kwargs)

    return initialize_megatron


def enable() -> TrainingCpuRules:
    """Apply the rules (none when CUDA is available); undo with the handle's ``disable()``."""
    rules = TrainingCpuRules()
    if torch.cuda.is_available():
        return rules
    try:
        for name in RULES:
            if getattr(rules, f"_{name}")():
                rules.applied.append(name)
    except BaseException:
        rules.disable()
        raise
    return rules


@contextlib.contextmanager
def training_on_cpu() -> Iterator[TrainingCpuRules]:
    """``with training_on_cpu() as rules:`` – `enable` on entry, ``disable()`` on exit."""
    rules = enable()
    try:
        yield rules
    finally:
        rules.disable()
