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
from typing import Any

from ...core import ChunkOffloadError, OffloadConfig
from .auto import ITERATION_MODES
from .modules import ALIASES, OFFLOAD_MODULE_NAMES, canonical_names

__all__ = ["BUDGET_FLAGS", "DESTS", "GROUP_TITLE", "LONG_PREFIX", "MEGATRON_OFFLOAD_SWITCHES", "PLANNED_FLAGS", "add_arguments", "has_arguments"]

GROUP_TITLE = "chunk-offload"
"""Title of the argument group `add_arguments` adds."""

LONG_PREFIX = "--chunk-offload-"
_ON_EXHAUSTED_CHOICES = ("fallback", "error")  # OffloadConfig.on_exhausted's Literal; a test keeps them equal

# Flag suffix -> destination in the parsed namespace. See NOTE [Flag names].
DESTS = {
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
PLANNED_FLAGS = ("prefetch-bytes", "reload-ahead-bytes", "device-budget")
"""Flags only the plan's policy reads (``--chunk-offload-schedule plan``)."""
BUDGET_FLAGS = ("device-budget", "host-budget", "host-pool-bytes", "prefetch-bytes", "reload-ahead-bytes")
"""Flags that bound what offload does: without --chunk-offload-modules (or with --chunk-offload-baseline) nothing uses them."""

# Megatron-LM's own activation offloading: namespace attribute -> its flag.
MEGATRON_OFFLOAD_SWITCHES = {
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
    return LONG_PREFIX + "modules" in parser._option_string_actions  # argparse has no public lookup


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
    taken = sorted(LONG_PREFIX + suffix for suffix in DESTS if LONG_PREFIX + suffix in existing)
    if taken:
        raise ChunkOffloadError(
            f"the parser already defines {taken}; add_arguments adds the chunk-offload flags once per parser "
            "(pass it as extra_args_provider only, or remove the other definition)."
        )

    def names(suffix: str) -> list[str]:
        return [LONG_PREFIX + suffix]

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
        dest=DESTS["modules"],
        nargs="+",
        action=_ModulesAction,
        default=None,
        metavar="NAMES",
        help=f"Submodules whose saved tensors are offloaded, comma- or space-separated: {_valid_names_text()}. Unset: no offload.",
    )
    group.add_argument(
        *names("min-offload-bytes"),
        dest=DESTS["min-offload-bytes"],
        type=_byte_count,
        default=defaults.min_offload_bytes,
        metavar="BYTES",
        help=f"Saved tensors smaller than this stay on device (default: {defaults.min_offload_bytes}).",
    )
    group.add_argument(
        *names("host-pool-bytes"),
        dest=DESTS["host-pool-bytes"],
        type=_byte_count,
        default=defaults.host_pool_bytes,
        metavar="BYTES",
        help="Cap on the pinned host memory of the pool (default: no cap).",
    )
    group.add_argument(
        *names("on-exhausted"),
        dest=DESTS["on-exhausted"],
        choices=_ON_EXHAUSTED_CHOICES,
        default=defaults.on_exhausted,
        help=(
            "At the host pool cap: 'fallback' allocates unpooled host buffers (one warning), 'error' raises "
            f"(default: {defaults.on_exhausted})."
        ),
    )
    group.add_argument(
        *names("baseline"),
        dest=DESTS["baseline"],
        action="store_true",
        help="Track the same groups and bytes but copy nothing: the baseline run of a memory comparison.",
    )
    group.add_argument(
        *names("profile-ranges"),
        dest=DESTS["profile-ranges"],
        action="store_true",
        help="Name each group's offload, reload and waits in torch.profiler traces (NVTX ranges under nsys on CUDA).",
    )
    group.add_argument(
        *names("schedule"),
        dest=DESTS["schedule"],
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
        dest=DESTS["prefetch-bytes"],
        type=_byte_count,
        default=None,
        metavar="BYTES",
        help="With --chunk-offload-schedule plan: bytes of a chunk reloaded ahead of its backward (default: its last group; 0: none).",
    )
    group.add_argument(
        *names("reload-ahead-bytes"),
        dest=DESTS["reload-ahead-bytes"],
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
        dest=DESTS["device-budget"],
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
        dest=DESTS["host-budget"],
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
        dest=DESTS["iterations"],
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
        dest=DESTS["report"],
        default=None,
        metavar="PATH",
        help=(
            "Produce the per-stage memory report (peak without and with offload, theoretical drop, R): the first "
            "training iteration runs as a baseline without copies, and the per-stage memory report will be written "
            "to PATH.json, PATH.png and PATH.md by the training loop (chunk_offload.report.write_report)."
        ),
    )
    return parser
