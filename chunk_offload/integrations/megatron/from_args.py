"""`attach_from_args` and `check_args`: chunk-offload's Megatron-LM flags (`args.add_arguments`), checked and applied.

`attach_from_args` refuses a Megatron ``--offload-modules`` given without Megatron's own
offloading switched on (a likely mix-up with ours) and refuses to run both offloading
mechanisms at once; `check_args` refuses flags that contradict each other and warns about flags
that would do nothing.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Sequence

from torch import nn

from ...core import ChunkOffloadError, OffloadConfig, StreamBackend, option
from ...module_names import check_combination
from ...option_flags import typed_flag
from .args import BUDGET_FLAGS, DESTS, FLAG_ROWS, LONG_PREFIX, MEGATRON_OFFLOAD_SWITCHES, PLANNED_FLAGS
from .attach import MegatronOffloadManager, attach

__all__ = ["attach_from_args", "check_args"]


def _check_megatron_offloading(args: argparse.Namespace, modules: Sequence[str] | None) -> None:
    """Refuse Megatron-LM offload flags that were likely meant for us, or that would run alongside us."""
    switched_on = [flag for attr, flag in MEGATRON_OFFLOAD_SWITCHES.items() if getattr(args, attr, False)]
    megatron_modules = getattr(args, "offload_modules", None)  # Megatron-LM's own --offload-modules
    if not modules:
        if megatron_modules and not switched_on:
            raise ChunkOffloadError(
                f"args.offload_modules={list(megatron_modules)!r} is Megatron-LM's own --offload-modules, which does "
                "nothing without --fine-grained-activation-offloading; chunk-offload reads --chunk-offload-modules. "
                f"Pass --chunk-offload-modules {','.join(megatron_modules)} instead."
            )
        return
    if switched_on:
        raise ChunkOffloadError(
            f"--chunk-offload-modules {','.join(modules)} cannot be combined with Megatron-LM's own activation "
            f"offloading ({', '.join(switched_on)}): both would move the same saved tensors. Use one of them."
        )


def _typed(args: argparse.Namespace, suffix: str) -> str:
    """``--flag value`` of flag ``suffix`` as typed (``--chunk-offload-device-budget 600KiB``): every
    message quotes flags through it."""
    return typed_flag(args, DESTS[suffix], LONG_PREFIX + suffix)


def _given(args: argparse.Namespace, suffixes: Sequence[str]) -> list[str]:
    """``--flag value`` as typed for each of ``suffixes`` that asks for something: set, and not to
    its default or to off (a switch given is named alone; ``--chunk-offload-timed-reload-ahead``
    asks only when ``on``)."""
    given = []
    for suffix in suffixes:
        value = getattr(args, DESTS[suffix], None)
        row = option(suffix)
        if value is None or value == row.default or row.to_field(value) is False:
            continue
        given.append(LONG_PREFIX + suffix if value is True else _typed(args, suffix))
    return given


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> None:
    """Check the parsed ``--chunk-offload-*`` flags against each other, naming them as typed.

    - plan-only flags (prefetch, reload-ahead, timed reload-ahead, device budget) under ``--chunk-offload-schedule
      group-start``, which never reads them: an error;
    - budget flags without ``--chunk-offload-modules``: nothing is offloaded, so they do nothing:
      a usage error at the command line (``parser`` given: exit status 2), a warning otherwise;
    - budget flags with ``--chunk-offload-baseline``, which copies nothing: a warning;
    - module combinations megatron-core refuses for its own offloading (`combination_problem`:
      ``attn_proj`` without ``core_attn``; MoE modules with ``--recompute-modules moe``): an error;
    - ``--chunk-offload-plan`` with ``--chunk-offload-modules`` or a host budget, or ``auto``
      without a device budget in bytes: an error;
    - ``--chunk-offload-layer-group-bytes`` other than its default with a ``--chunk-offload-group-by``
      other than ``layer``: an error.

    `attach_from_args` calls it without ``parser``; a command line calls it with its parser right
    after parsing.
    """
    _check_plan(args, parser)
    group_by = getattr(args, DESTS["group-by"], option("group-by").default)
    if _given(args, ["layer-group-bytes"]) and group_by != "layer":
        _refuse(f"{_typed(args, 'layer-group-bytes')} bounds layer groups: add {LONG_PREFIX}group-by layer (got {group_by!r})", parser)
    modules = getattr(args, DESTS["modules"], None)
    if modules:
        recompute = getattr(args, "recompute_modules", None) if getattr(args, "recompute_granularity", None) == "selective" else None
        try:
            check_combination(modules, recompute or (), modules_flag=LONG_PREFIX + "modules", recompute_flag="--recompute-modules")
        except ChunkOffloadError as e:
            _refuse(str(e).removeprefix("chunk_offload: "), parser)
    schedule = getattr(args, DESTS["schedule"], "plan")
    planned = _given(args, PLANNED_FLAGS)
    if planned and schedule != "plan":
        message = (
            f"{', '.join(planned)} is never used by {LONG_PREFIX}schedule {schedule}, which reloads each group when "
            f"backward reaches the group after it; use {LONG_PREFIX}schedule plan (the default) or drop "
            f"{'it' if len(planned) == 1 else 'them'}"
        )
        _refuse(message, parser)
    budgets = _given(args, BUDGET_FLAGS)
    if budgets and not getattr(args, DESTS["modules"], None) and getattr(args, DESTS["plan"], None) is None:
        message = (
            f"{', '.join(budgets)} given without {LONG_PREFIX}modules: nothing will be offloaded, so "
            f"{'it does' if len(budgets) == 1 else 'they do'} nothing; add {LONG_PREFIX}modules NAMES or drop "
            f"{'it' if len(budgets) == 1 else 'them'}"
        )
        if parser is not None:
            parser.error(message)
        warnings.warn(f"chunk_offload: {message}", stacklevel=3)
    elif budgets and getattr(args, DESTS["baseline"], False):
        warnings.warn(
            f"chunk_offload: {', '.join(budgets)} with {LONG_PREFIX}baseline, which copies nothing: "
            f"{'it is' if len(budgets) == 1 else 'they are'} not used in this run",
            stacklevel=3,
        )


def _check_plan(args: argparse.Namespace, parser: argparse.ArgumentParser | None) -> None:
    """``--chunk-offload-plan``: it chooses the modules, ``auto`` plans for a device budget in bytes,
    and its stages attach different modules, which a node host budget cannot split among."""
    plan = getattr(args, DESTS["plan"], None)
    if plan is None:
        return
    flag = _typed(args, "plan")
    if getattr(args, DESTS["modules"], None):
        _refuse(f"{flag} chooses the offload modules per stage; drop {LONG_PREFIX}modules (or the plan)", parser)
    budget = getattr(args, DESTS["device-budget"], None)
    if plan == "auto" and not isinstance(budget, int):
        got = f"got {_typed(args, 'device-budget')}" if budget is not None else "none was given"
        _refuse(f"{flag} plans for a device budget in bytes: add {LONG_PREFIX}device-budget BYTES ({got})", parser)
    if getattr(args, DESTS["host-budget"], None) is not None:
        _refuse(f"{flag} cannot be combined with {LONG_PREFIX}host-budget: the stages offload different modules; drop one", parser)


def _refuse(message: str, parser: argparse.ArgumentParser | None) -> None:
    if parser is not None:
        parser.error(message)
    raise ChunkOffloadError(message)


def attach_from_args(
    model: nn.Module | Sequence[nn.Module],
    args: argparse.Namespace,
    *,
    streams: StreamBackend | None = None,
    baseline_iterations: int | None = None,
    trace: bool | None = None,
    measure_time: bool | None = None,
    iterations: str | None = None,
) -> MegatronOffloadManager | None:
    """`attach` with the options parsed by `add_arguments`; None when no module was given.

    With ``--chunk-offload-report`` the manager runs its first training iteration as a baseline
    without copies (``baseline_iterations=1``) and traces memory (``trace=True``) for
    ``manager.report()``. With ``--chunk-offload-iterations auto`` it is attached with
    ``iterations="auto"`` (no wrap; Megatron's ``get_num_microbatches()`` per iteration).

    Args:
        model: the rank's model chunks (one per virtual stage) or a single chunk.
        args: the namespace parsed with `add_arguments` (Megatron-LM's ``get_args()``).
        streams: the engine's stream backend (None: the default).
        baseline_iterations, trace, measure_time, iterations: applied over what ``args`` sets
            (None: from ``args``); the launcher passes ``iterations="auto"``.

    Raises `ChunkOffloadError` when ``args`` was not parsed with `add_arguments`, when it has
    ``--chunk-offload-verify`` (the launcher's: it runs the job twice), when it also
    asks for Megatron-LM's own activation offloading (NOTE [Flag names]), or when its flags
    contradict each other (`check_args`, which also warns about flags that would do nothing).
    """
    missing = [f"{LONG_PREFIX}{suffix} ({dest})" for suffix, dest in DESTS.items() if not hasattr(args, dest)]
    if missing:
        raise ChunkOffloadError(
            f"args has no {missing}; parse the command line with chunk_offload.integrations.megatron.add_arguments "
            "(Megatron-LM: extra_args_provider=add_arguments)."
        )
    verify = getattr(args, DESTS["verify"])
    if verify is not None:
        raise ChunkOffloadError(
            f"{LONG_PREFIX}verify {verify} is the launcher's: python -m chunk_offload.megatron_lm SCRIPT ... runs the job "
            "twice and compares; in a training loop of your own call chunk_offload.verify_bit_identity, and drop the flag"
        )
    plan = getattr(args, DESTS["plan"])
    if plan is not None:
        raise ChunkOffloadError(
            f"{LONG_PREFIX}plan {plan} is the launcher's: python -m chunk_offload.megatron_lm SCRIPT ... applies it before "
            "the model is built; in a script of your own run chunk_offload.planner.co_plan and pass its modules and "
            "Megatron flags"
        )
    modules = getattr(args, DESTS["modules"])
    _check_megatron_offloading(args, modules)
    check_args(args)
    if not modules:
        return None
    report = bool(getattr(args, DESTS["report"]))
    fields = {row.field: row.to_field(getattr(args, row.dest)) for row in FLAG_ROWS if row.owner in ("OffloadConfig", "ScheduleOptions")}
    config = OffloadConfig(**{row.field_name: fields[row.field] for row in FLAG_ROWS if row.owner == "OffloadConfig"})
    config.trace = report if trace is None else trace  # the report's plot of memory over one iteration
    if measure_time is not None:
        config.measure_time = measure_time
    if baseline_iterations is None:
        baseline_iterations = 1 if report else 0  # the report's peak without offload
    schedule_options = {row.field_name: fields[row.field] for row in FLAG_ROWS if row.owner == "ScheduleOptions"}
    return attach(
        model,
        modules,
        config=config,
        streams=streams,
        **schedule_options,  # ScheduleOptions' fields are attach's keywords
        baseline_iterations=baseline_iterations,
        iterations=getattr(args, DESTS["iterations"]) if iterations is None else iterations,
    )
