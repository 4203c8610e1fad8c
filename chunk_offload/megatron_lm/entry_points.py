"""`EntryPoints`: wrap megatron.training's public entry points for one run of a training script.

What is wrapped, at every module that binds the name (a script's ``from megatron.training import
pretrain`` copies the reference, so the attribute is replaced where scripts and Megatron-LM look
it up: ``megatron.training``, ``megatron.training.training``, ``.arguments``, ``.initialize``):

* ``parse_and_validate_args`` (core_v0.19) and ``initialize_megatron`` / ``pretrain`` (core_v0.16,
  where they take ``extra_args_provider``): the script's ``extra_args_provider`` is composed with
  `add_arguments` (the script's flags first, then ours; a provider that already added ours is
  left alone).
* ``pretrain``: a ``model_provider`` argument (any signature; every argument, ``config=`` and
  ``pg_collection=`` included, is passed through) is wrapped so that the rank's chunks are
  attached once its last chunk is built; a config container whose model config has
  ``pre_wrap_hooks`` (core_v0.19, the model built from the config inside ``pretrain``) gets a
  hook that attaches to the bare chunks before Megatron-LM wraps them in DDP / Float16Module.
  After ``pretrain`` returns, every rank's `StageSummary` is gathered to rank 0 (a collective),
  where `close_run` writes the report (``--chunk-offload-report``) and prepares the closing
  summary (``closing``, printed by the launcher); in any case the manager is closed. With
  ``summary_on_exit`` also when Megatron-LM ends the run early with ``sys.exit(0)``.

Our flags' defaults are Megatron-LM's parser's too, but for ``--chunk-offload-iterations``, whose
default there is ``auto``: what runs (Megatron-LM prints every argument at start-up).

Attaching goes through `attach_from_args` with ``iterations="auto"``: Megatron-LM's ``train_step``
calls ``get_forward_backward_func()`` itself, so there is nothing to wrap.

NOTE [One build per run]
Megatron-LM may build a second model in one ``pretrain`` (MoE upcycling builds a dense one first;
RL builds an inference model). Only the first build is attached; a later one is left alone with
a warning, so that one manager owns the chunks that train.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
from torch import nn

from ..integrations.megatron import MegatronOffloadManager, add_arguments, attach_from_args
from ..integrations.megatron.args import has_arguments
from ..report import ReportFiles, gather_objects
from ..option_flags import typed_flag
from ..planner.coplan import CoPlan
from .closing import Closing, close_run
from .plan import apply_plan, describe, resolve_plan, stage_modules
from .summary import stage_summary

__all__ = ["EntryPoints"]

logger = logging.getLogger(__name__)  # the launcher's console (cli.py) prints what it says

_ARGS_ENTRY_POINTS = ("parse_and_validate_args", "initialize_megatron")
_BINDING_MODULES = (
    "megatron.training",
    "megatron.training.training",
    "megatron.training.arguments",
    "megatron.training.initialize",
)
_COMPOSED = "__chunk_offload_composed__"


@dataclass(slots=True)
class _Patch:
    owner: Any
    name: str
    original: Any


class EntryPoints:
    """The wrapped entry points of one script run, and the manager attached in it.

    ``install()`` replaces the entry points, ``restore()`` puts them back (idempotent). Usable as a
    context manager. On a CPU-only host enable `chunk_offload.devkit.cpu_compat` and
    `chunk_offload.devkit.megatron_training_cpu` first (`run_script` does).
    """

    def __init__(self, *, summary_on_exit: bool = False) -> None:
        self.summary_on_exit = summary_on_exit
        """Also gather the summaries when Megatron-LM ends training with ``sys.exit(0)`` (its
        ``--exit-interval``): the child runs of ``--chunk-offload-verify`` end so (NOTE [Verify runs])."""
        self.manager: MegatronOffloadManager | None = None
        self._patches: list[_Patch] = []
        self._pending: list[nn.Module] = []
        self._builds = 0
        self.report_files: ReportFiles | None = None
        """The report files written on rank 0 (``--chunk-offload-report``)."""
        self.plan: CoPlan | None = None
        """``--chunk-offload-plan``'s plan, once Megatron-LM's arguments are parsed (None without)."""
        self.closing: Closing | None = None
        """Rank 0, after ``pretrain``: the closing summary, warnings and error of the run."""

    # -- installation -------------------------------------------------------------------------

    def install(self) -> EntryPoints:
        """Wrap the entry points in every module of ``megatron.training`` that binds them."""
        modules = [importlib.import_module(name) for name in _BINDING_MODULES]
        wrappers: dict[Any, Any] = {}  # original -> its wrapper, so one original gets one wrapper
        for module in modules:
            for name in (*_ARGS_ENTRY_POINTS, "pretrain"):
                original = module.__dict__.get(name)
                if original is None or not callable(original):
                    continue
                make = self._wrap_pretrain if name == "pretrain" else self._wrap_args_entry
                wrapper = wrappers.get(original) or wrappers.setdefault(original, make(original))
                self._patches.append(_Patch(module, name, original))
                setattr(module, name, wrapper)
        return self

    def restore(self) -> None:
        """Put every wrapped entry point back, newest first."""
        for patch in reversed(self._patches):
            setattr(patch.owner, patch.name, patch.original)
        self._patches.clear()

    def __enter__(self) -> EntryPoints:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    @property
    def wrapped(self) -> tuple[str, ...]:
        """``module.name`` of every entry point currently wrapped."""
        return tuple(f"{p.owner.__name__}.{p.name}" for p in self._patches)

    # -- arguments ----------------------------------------------------------------------------

    def _wrap_args_entry(self, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def entry(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = _compose_provider(signature, args, kwargs)
            result = original(*args, **kwargs)
            self._apply_plan()
            return result

        return entry

    # -- pretrain -----------------------------------------------------------------------------

    def _wrap_pretrain(self, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def pretrain(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = _compose_provider(signature, args, kwargs)
            bound = signature.bind_partial(*args, **kwargs)
            provider = bound.arguments.get("model_provider")
            if provider is not None:
                bound.arguments["model_provider"] = self._wrap_provider(provider)
            container = bound.arguments.get("cfg_container")
            hooks = getattr(getattr(container, "model", None), "pre_wrap_hooks", None)
            if isinstance(hooks, list):
                hooks.append(self._pre_wrap_hook)
            try:
                try:
                    result = original(*bound.args, **bound.kwargs)
                except SystemExit as e:  # Megatron-LM's early exit (--exit-interval), on every rank at once
                    if self.summary_on_exit and e.code in (0, None):
                        self._after_training()
                    raise
                self._after_training()
                return result
            finally:
                if isinstance(hooks, list) and self._pre_wrap_hook in hooks:
                    hooks.remove(self._pre_wrap_hook)
                if self.manager is not None:
                    self.manager.close()

        return pretrain

    def _wrap_provider(self, provider: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        @functools.wraps(provider)
        def model_provider(*args: Any, **kwargs: Any) -> nn.Module:
            chunk = provider(*args, **kwargs)
            self._pending.append(chunk)
            if len(self._pending) == _chunks_per_rank():
                chunks, self._pending = self._pending, []
                self._attach(chunks)
            return chunk

        return model_provider

    def _pre_wrap_hook(self, chunks: list[nn.Module]) -> list[nn.Module]:
        self._attach(list(chunks))
        return chunks

    def _attach(self, chunks: list[nn.Module]) -> None:
        """Attach to the rank's chunks of the first model build. See NOTE [One build per run]."""
        from megatron.training import get_args

        self._builds += 1
        if self._builds > 1:
            warnings.warn(
                f"chunk_offload: Megatron-LM built a model a {self._builds}. time in this run; only the first "
                "build is offloaded (NOTE [One build per run] in chunk_offload/megatron_lm/entry_points.py)",
                stacklevel=2,
            )
            return
        args = get_args()
        if self.plan is not None:  # this stage's modules; the plan's own flags are the launcher's
            from megatron.core import parallel_state

            modules = stage_modules(self.plan, parallel_state.get_pipeline_model_parallel_rank())
            # The plan met the budget with these modules; the run-time budget would choose again, by
            # the saved bytes of the offloaded modules alone (NOTE [Device budget]), so it is not passed on.
            planned = {"chunk_offload_plan": None, "chunk_offload_modules": modules or None, "chunk_offload_device_budget": None}
            args = argparse.Namespace(**{**vars(args), **planned})
        self.manager = attach_from_args(chunks, args, iterations="auto")

    def _apply_plan(self) -> None:
        """``--chunk-offload-plan``: resolve it once Megatron-LM's arguments are checked, set its
        recompute on them before any model is built, and say what it set (rank 0)."""
        from megatron.training import get_args

        args = get_args()
        if self.plan is not None or getattr(args, "chunk_offload_plan", None) is None:
            return
        self.plan = resolve_plan(args)
        apply_plan(args, self.plan)
        if getattr(args, "rank", 0) == 0:
            logger.info("%s", describe(self.plan))

    def _after_training(self) -> None:
        """Gather every rank's summary to rank 0 (a collective) and close the run there."""
        from megatron.training import get_args

        args = get_args()
        requested = getattr(args, "chunk_offload_modules", None)
        if self.plan is not None:
            requested = self.manager.offload_modules if self.manager is not None else []
        elif not requested:  # the same on every rank: no collective
            first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
            self.closing = close_run(None, report_path=None) if first else None
            return
        path = getattr(args, "chunk_offload_report", None)
        planned_nothing = self.plan is not None and self.manager is None
        flag = typed_flag(args, "chunk_offload_min_offload_bytes", "--chunk-offload-min-offload-bytes")
        summary = stage_summary(self.manager, requested=list(requested), report=bool(path), planned_nothing=planned_nothing, min_offload_flag=flag)
        summaries = gather_objects(summary)
        if summaries is not None:
            self.closing = close_run(summaries, report_path=path)
            self.report_files = self.closing.files


def _chunks_per_rank() -> int:
    """How many model chunks Megatron-LM's ``get_model`` builds on this rank (one per virtual stage)."""
    from megatron.training import get_args

    args = get_args()
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    return vp if vp and args.pipeline_model_parallel_size > 1 else 1


def _compose_provider(signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the ``extra_args_provider`` argument composed with `add_arguments`."""
    if "extra_args_provider" not in signature.parameters:
        return args, kwargs
    bound = signature.bind_partial(*args, **kwargs)
    bound.arguments["extra_args_provider"] = _composed(bound.arguments.get("extra_args_provider"))
    return bound.args, bound.kwargs


def _composed(provider: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """``provider`` followed by `add_arguments` (unless ``provider`` already added our flags), with
    ``--chunk-offload-iterations`` defaulting to ``auto``, the mode the launcher runs."""
    if getattr(provider, _COMPOSED, False):
        return provider

    def extra_args_provider(parser: Any) -> Any:
        parser = parser if provider is None else provider(parser)
        parser = parser if has_arguments(parser) else add_arguments(parser)
        parser.set_defaults(chunk_offload_iterations="auto")  # what runs: Megatron-LM prints it
        return parser

    setattr(extra_args_provider, _COMPOSED, True)
    return extra_args_provider
