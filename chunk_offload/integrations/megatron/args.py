"""Megatron-LM command-line flags for chunk-offload, and `attach` from the parsed arguments.

`add_arguments` has the signature Megatron-LM expects of an ``extra_args_provider``::

    from chunk_offload.integrations.megatron import add_arguments, attach_from_args

    initialize_megatron(extra_args_provider=add_arguments)   # or pretrain(..., extra_args_provider=...)
    manager = attach_from_args(model_chunks, get_args())      # None without --chunk-offload-modules
    if manager is not None:
        forward_backward_func = manager.wrap(get_forward_backward_func())

With ``--chunk-offload-iterations auto`` no wrap is needed: the manager delimits the iterations
itself (for Megatron-LM's ``pretrain``, whose ``train_step`` calls ``get_forward_backward_func()``).

Flags (group "chunk-offload"); every value lands in ``args.chunk_offload_*``:

* ``--chunk-offload-modules core_attn,qkv_linear``: what to offload (comma- or space-separated
  names from `OFFLOAD_MODULE_NAMES`, aliases from `ALIASES`), checked while parsing.
* ``--chunk-offload-min-offload-bytes N``: saved tensors smaller than N bytes stay on device.
* ``--chunk-offload-host-pool-bytes N``: cap on pinned host memory (unset: no cap).
* ``--chunk-offload-on-exhausted fallback|error``: what happens at the cap.
* ``--chunk-offload-baseline``: track the same groups and bytes but copy nothing.
* ``--chunk-offload-device-budget BYTES|auto``: device bytes per rank; the manager chooses what
  to offload (``attach(..., device_budget_bytes=...)``, NOTE [Device budget] in
  ``integrations/budgets.py``); ``auto`` levels the pipeline ranks' peaks.
* ``--chunk-offload-host-budget BYTES``: pinned host bytes of the node, split among its ranks
  by need (``host_budget_bytes``).
* ``--chunk-offload-iterations wrap|auto``: ``wrap`` (default): each call of
  ``manager.wrap(get_forward_backward_func())`` is one iteration; ``auto``: the manager opens and
  closes iterations itself, with Megatron's ``get_num_microbatches()`` forwards per model chunk
  (``attach(..., iterations="auto")``, NOTE [Automatic iterations] in ``attach.py``).
* ``--chunk-offload-report PATH``: produce the per-stage memory report. `attach_from_args` then
  runs the first training iteration as a baseline without copies (``baseline_iterations=1``)
  and traces memory (``trace=True``), so ``manager.report()`` can compare the baseline with the
  later iterations; the training loop gathers the ranks' reports and writes them to
  ``PATH.json``, ``PATH.png`` and ``PATH.md`` (a ``.json``, ``.png`` or ``.md`` suffix of PATH is
  dropped first)::

      from chunk_offload.report import gather_reports, write_report

      reports = gather_reports(manager.report())   # a collective: every rank calls it
      if reports is not None:                       # rank 0
          write_report(reports, args.chunk_offload_report)

Byte counts accept a plain integer or one with a binary suffix (``512KiB``, ``1MiB``, ``64GiB``).

NOTE [Flag names]
Megatron-LM defines flags of its own for its built-in offloading: ``--offload-modules`` and
``--min-offloaded-tensor-size`` (generated from ``TransformerConfig``, for
``--fine-grained-activation-offloading``) and ``--cpu-offloading*``. An ``extra_args_provider``
adds its flags to Megatron-LM's parser, and argparse refuses a second ``--offload-modules`` with
"conflicting option string". Our flags therefore all start with ``--chunk-offload-`` and store to
``chunk_offload_*`` destinations, which no Megatron flag uses, and are named after the
`OffloadConfig` / `attach` options they set (``--chunk-offload-min-offload-bytes`` sets
``min_offload_bytes``). There are no shorter ``--offload-*`` spellings.
`attach_from_args` refuses a Megatron ``--offload-modules`` given without Megatron's own
offloading switched on (a likely mix-up with ours) and refuses to run both offloading
mechanisms at once.
"""

from __future__ import annotations

import argparse
import re
import warnings
from typing import Any, Sequence

from torch import nn

from ...core import ChunkOffloadError, OffloadConfig, StreamBackend
from .attach import MegatronOffloadManager, attach
from .auto import ITERATION_MODES
from .modules import ALIASES, OFFLOAD_MODULE_NAMES, canonical_names

__all__ = ["GROUP_TITLE", "add_arguments", "attach_from_args", "check_args", "has_arguments"]

GROUP_TITLE = "chunk-offload"
"""Title of the argument group `add_arguments` adds."""

_LONG_PREFIX = "--chunk-offload-"
_ON_EXHAUSTED_CHOICES = ("fallback", "error")  # OffloadConfig.on_exhausted's Literal; a test keeps them equal

# Flag suffix -> destination in the parsed namespace. See NOTE [Flag names].
_DESTS = {
    "modules": "chunk_offload_modules",
    "min-offload-bytes": "chunk_offload_min_offload_bytes",
    "host-pool-bytes": "chunk_offload_host_pool_bytes",
    "on-exhausted": "chunk_offload_on_exhausted",
    "baseline": "chunk_offload_baseline",
    "report": "chunk_offload_report",
    "schedule": "chunk_offload_schedule",
    "prefetch-bytes": "chunk_offload_prefetch_bytes",
    "reload-ahead-bytes": "chunk_offload_reload_ahead_bytes",
    "iterations": "chunk_offload_iterations",
    "device-budget": "chunk_offload_device_budget",
    "host-budget": "chunk_offload_host_budget",
    "profile-ranges": "chunk_offload_profile_ranges",
}
_SCHEDULE_CHOICES = ("plan", "group-start")
_PLANNED = ("prefetch-bytes", "reload-ahead-bytes", "device-budget")
"""Flags only the plan's policy reads (``--chunk-offload-schedule plan``)."""
_BUDGETS = ("device-budget", "host-budget", "host-pool-bytes", "prefetch-bytes", "reload-ahead-bytes")
"""Flags that bound what offload does: without --chunk-offload-modules (or with --chunk-offload-baseline) nothing uses them."""

# Megatron-LM's own activation offloading: namespace attribute -> its flag.
_MEGATRON_OFFLOAD_SWITCHES = {
    "fine_grained_activation_offloading": "--fine-grained-activation-offloading",
    "cpu_offloading": "--cpu-offloading",
}

_SIZE_UNITS = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")


def _byte_count(text: str) -> int:
    """argparse ``type``: a byte count >= 0, as an integer with an optional binary suffix."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"expected a byte count >= 0 such as 1048576 or 1MiB (suffixes KiB, MiB, GiB, TiB), got {text!r}"
        )
    return int(match.group(1)) * _SIZE_UNITS[unit]


def _device_budget(text: str) -> int | str:
    """argparse ``type``: ``auto`` or a byte count (`_byte_count`)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return _byte_count(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or a byte count >= 0 such as 60GiB or 600KiB (suffixes KiB, MiB, GiB, TiB), got {text!r}"
        ) from None


class _ModulesAction(argparse.Action):
    """Join the comma- or space-separated names, resolve aliases and reject unknown names at parse time."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        tokens = [values] if isinstance(values, str) else list(values)
        try:
            names = canonical_names(",".join(tokens))
        except ChunkOffloadError as e:
            raise argparse.ArgumentError(self, str(e).removeprefix("chunk_offload: ")) from e
        setattr(namespace, self.dest, names)


def _valid_names_text() -> str:
    aliases = ", ".join(f"{alias} (= {name})" for alias, name in sorted(ALIASES.items()))
    return f"{', '.join(OFFLOAD_MODULE_NAMES)}; aliases: {aliases}"


def has_arguments(parser: argparse.ArgumentParser) -> bool:
    """True when `add_arguments` already added the chunk-offload flags to ``parser``."""
    return _LONG_PREFIX + "modules" in parser._option_string_actions  # argparse has no public lookup


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "chunk-offload" argument group to ``parser`` and return ``parser``.

    Usable as Megatron-LM's ``extra_args_provider``; every flag starts with ``--chunk-offload-``
    (NOTE [Flag names]).
    Raises `ChunkOffloadError` if ``parser`` already has a ``--chunk-offload-*`` flag (e.g. when
    called twice on one parser).
    """
    if not isinstance(parser, argparse.ArgumentParser):
        raise ChunkOffloadError(f"add_arguments expects an argparse.ArgumentParser, got {type(parser).__name__}")
    existing = parser._option_string_actions  # argparse has no public lookup of defined flags
    taken = sorted(_LONG_PREFIX + suffix for suffix in _DESTS if _LONG_PREFIX + suffix in existing)
    if taken:
        raise ChunkOffloadError(
            f"the parser already defines {taken}; add_arguments adds the chunk-offload flags once per parser "
            "(pass it as extra_args_provider only, or remove the other definition)."
        )

    def names(suffix: str) -> list[str]:
        return [_LONG_PREFIX + suffix]

    defaults = OffloadConfig()
    group = parser.add_argument_group(
        title=GROUP_TITLE,
        description=(
            "Offload what chosen submodules save for backward to pinned host memory, per pipeline chunk "
            "(chunk_offload.integrations.megatron.attach_from_args). Byte counts take an integer or a "
            "KiB/MiB/GiB/TiB suffix."
        ),
    )
    group.add_argument(
        *names("modules"),
        dest=_DESTS["modules"],
        nargs="+",
        action=_ModulesAction,
        default=None,
        metavar="NAMES",
        help=f"Submodules whose saved tensors are offloaded, comma- or space-separated: {_valid_names_text()}. Unset: no offload.",
    )
    group.add_argument(
        *names("min-offload-bytes"),
        dest=_DESTS["min-offload-bytes"],
        type=_byte_count,
        default=defaults.min_offload_bytes,
        metavar="BYTES",
        help=f"Saved tensors smaller than this stay on device (default: {defaults.min_offload_bytes}).",
    )
    group.add_argument(
        *names("host-pool-bytes"),
        dest=_DESTS["host-pool-bytes"],
        type=_byte_count,
        default=defaults.host_pool_bytes,
        metavar="BYTES",
        help="Cap on the pinned host memory of the pool (default: no cap).",
    )
    group.add_argument(
        *names("on-exhausted"),
        dest=_DESTS["on-exhausted"],
        choices=_ON_EXHAUSTED_CHOICES,
        default=defaults.on_exhausted,
        help=(
            "At the host pool cap: 'fallback' allocates unpooled host buffers (one warning), 'error' raises "
            f"(default: {defaults.on_exhausted})."
        ),
    )
    group.add_argument(
        *names("baseline"),
        dest=_DESTS["baseline"],
        action="store_true",
        help="Track the same groups and bytes but copy nothing: the baseline run of a memory comparison.",
    )
    group.add_argument(
        *names("profile-ranges"),
        dest=_DESTS["profile-ranges"],
        action="store_true",
        help="Name each group's offload, reload and waits in torch.profiler traces (NVTX ranges under nsys on CUDA).",
    )
    group.add_argument(
        *names("schedule"),
        dest=_DESTS["schedule"],
        choices=_SCHEDULE_CHOICES,
        default="plan",
        help=(
            "'plan' (default): decisions from Megatron's schedule table: chunks whose backward follows at once stay "
            "on device, and the next backward chunk is reloaded during the action before it. 'group-start': offload "
            "every chunk and reload each group when backward reaches the group after it."
        ),
    )
    group.add_argument(
        *names("prefetch-bytes"),
        dest=_DESTS["prefetch-bytes"],
        type=_byte_count,
        default=None,
        metavar="BYTES",
        help="With --chunk-offload-schedule plan: bytes of a chunk reloaded ahead of its backward (default: its last group; 0: none).",
    )
    group.add_argument(
        *names("reload-ahead-bytes"),
        dest=_DESTS["reload-ahead-bytes"],
        type=_byte_count,
        default=None,
        metavar="BYTES",
        help=(
            "With --chunk-offload-schedule plan: in a chunk's backward, bytes of earlier groups that may be reloading "
            "ahead of the running one (default: one group ahead). Hides a large group's copy behind small groups."
        ),
    )
    group.add_argument(
        *names("device-budget"),
        dest=_DESTS["device-budget"],
        type=_device_budget,
        default=None,
        metavar="BYTES|auto",
        help=(
            "With --chunk-offload-schedule plan: device bytes this rank may use; each rank offloads the fewest groups "
            "whose predicted peak fits (a rank that fits offloads nothing). CUDA: bounds max_memory_allocated; CPU: "
            "the saved-bytes accounting. 'auto': the smallest budget every pipeline rank meets. Default: no budget."
        ),
    )
    group.add_argument(
        *names("host-budget"),
        dest=_DESTS["host-budget"],
        type=_byte_count,
        default=None,
        metavar="BYTES",
        help=(
            "Pinned host bytes of the whole node, split among its ranks by what each rank's plan puts on host "
            "(early stages get more); each rank's host pool cap follows after the first iteration. Default: no budget."
        ),
    )
    group.add_argument(
        *names("iterations"),
        dest=_DESTS["iterations"],
        choices=ITERATION_MODES,
        default="wrap",
        help=(
            "'wrap' (default): each call of manager.wrap(get_forward_backward_func()) is one offload iteration. "
            "'auto': the manager opens an iteration at the first training forward of each step and closes it when "
            "every model chunk ran get_num_microbatches() forwards and their backwards; for training loops that call "
            "get_forward_backward_func() themselves (Megatron-LM's pretrain)."
        ),
    )
    group.add_argument(
        *names("report"),
        dest=_DESTS["report"],
        default=None,
        metavar="PATH",
        help=(
            "Produce the per-stage memory report (peak without and with offload, theoretical drop, R): the first "
            "training iteration runs as a baseline without copies, and the per-stage memory report will be written "
            "to PATH.json, PATH.png and PATH.md by the training loop (chunk_offload.report.write_report)."
        ),
    )
    return parser


def _check_megatron_offloading(args: argparse.Namespace, modules: Sequence[str] | None) -> None:
    """Refuse Megatron-LM offload flags that were likely meant for us, or that would run alongside us."""
    switched_on = [flag for attr, flag in _MEGATRON_OFFLOAD_SWITCHES.items() if getattr(args, attr, False)]
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


def _given(args: argparse.Namespace, suffixes: Sequence[str]) -> list[str]:
    """``--flag value`` for each of ``suffixes`` set on the command line (their defaults are None)."""
    given = []
    for suffix in suffixes:
        value = getattr(args, _DESTS[suffix], None)
        if value is not None:
            given.append(f"{_LONG_PREFIX}{suffix} {value}")
    return given


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> None:
    """Check the parsed ``--chunk-offload-*`` flags against each other, naming them as typed.

    - plan-only flags (prefetch, reload-ahead, device budget) under ``--chunk-offload-schedule
      group-start``, which never reads them: an error;
    - budget flags without ``--chunk-offload-modules``: nothing is offloaded, so they do nothing:
      a usage error at the command line (``parser`` given: exit status 2), a warning otherwise;
    - budget flags with ``--chunk-offload-baseline``, which copies nothing: a warning.

    `attach_from_args` calls it without ``parser``; a command line calls it with its parser right
    after parsing.
    """
    schedule = getattr(args, _DESTS["schedule"], "plan")
    planned = _given(args, _PLANNED)
    if planned and schedule != "plan":
        message = (
            f"{', '.join(planned)} is never used by {_LONG_PREFIX}schedule {schedule}, which reloads each group when "
            f"backward reaches the group after it; use {_LONG_PREFIX}schedule plan (the default) or drop "
            f"{'it' if len(planned) == 1 else 'them'}"
        )
        _refuse(message, parser)
    budgets = _given(args, _BUDGETS)
    if budgets and not getattr(args, _DESTS["modules"], None):
        message = (
            f"{', '.join(budgets)} given without {_LONG_PREFIX}modules: nothing will be offloaded, so "
            f"{'it does' if len(budgets) == 1 else 'they do'} nothing; add {_LONG_PREFIX}modules NAMES or drop "
            f"{'it' if len(budgets) == 1 else 'them'}"
        )
        if parser is not None:
            parser.error(message)
        warnings.warn(f"chunk_offload: {message}", stacklevel=3)
    elif budgets and getattr(args, _DESTS["baseline"], False):
        warnings.warn(
            f"chunk_offload: {', '.join(budgets)} with {_LONG_PREFIX}baseline, which copies nothing: "
            f"{'it is' if len(budgets) == 1 else 'they are'} not used in this run",
            stacklevel=3,
        )


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

    Raises `ChunkOffloadError` when ``args`` was not parsed with `add_arguments`, when it also
    asks for Megatron-LM's own activation offloading (NOTE [Flag names]), or when its flags
    contradict each other (`check_args`, which also warns about flags that would do nothing).
    """
    missing = [f"{_LONG_PREFIX}{suffix} ({dest})" for suffix, dest in _DESTS.items() if not hasattr(args, dest)]
    if missing:
        raise ChunkOffloadError(
            f"args has no {missing}; parse the command line with chunk_offload.integrations.megatron.add_arguments "
            "(Megatron-LM: extra_args_provider=add_arguments)."
        )
    modules = getattr(args, _DESTS["modules"])
    _check_megatron_offloading(args, modules)
    check_args(args)
    if not modules:
        return None
    report = bool(getattr(args, _DESTS["report"]))
    config = OffloadConfig(
        min_offload_bytes=getattr(args, _DESTS["min-offload-bytes"]),
        host_pool_bytes=getattr(args, _DESTS["host-pool-bytes"]),
        on_exhausted=getattr(args, _DESTS["on-exhausted"]),
        offload=not getattr(args, _DESTS["baseline"]),
        trace=report if trace is None else trace,  # the report's plot of memory over one iteration
        profile_ranges=getattr(args, _DESTS["profile-ranges"]),
    )
    if measure_time is not None:
        config.measure_time = measure_time
    if baseline_iterations is None:
        baseline_iterations = 1 if report else 0  # the report's peak without offload
    return attach(
        model,
        modules,
        config=config,
        streams=streams,
        schedule_policy="plan" if getattr(args, _DESTS["schedule"]) == "plan" else None,
        prefetch_bytes=getattr(args, _DESTS["prefetch-bytes"]),
        reload_ahead_bytes=getattr(args, _DESTS["reload-ahead-bytes"]),
        device_budget_bytes=getattr(args, _DESTS["device-budget"]),
        host_budget_bytes=getattr(args, _DESTS["host-budget"]),
        baseline_iterations=baseline_iterations,
        iterations=getattr(args, _DESTS["iterations"]) if iterations is None else iterations,
    )
