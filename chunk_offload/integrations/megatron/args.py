"""Megatron-LM command-line flags for chunk-offload, and `attach` from the parsed arguments.

`add_arguments` has the signature Megatron-LM expects of an ``extra_args_provider``::

    from chunk_offload.integrations.megatron import add_arguments, attach_from_args

    initialize_megatron(extra_args_provider=add_arguments)   # or pretrain(..., extra_args_provider=...)
    manager = attach_from_args(model_chunks, get_args())      # None without --chunk-offload-modules
    if manager is not None:
        forward_backward_func = manager.wrap(get_forward_backward_func())

With ``--chunk-offload-iterations auto`` no wrap is needed: the manager delimits the iterations
itself (for Megatron-LM's ``pretrain``, whose ``train_step`` calls ``get_forward_backward_func()``).

Flags (group "chunk-offload"), one per row of the option table (`chunk_offload.core.OPTIONS`,
which also holds their defaults, help and the config field each sets); every value lands in
``args.chunk_offload_*``:

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
* ``--chunk-offload-deterministic-memory``: compute waits on each group's copy before its
  device originals are released (``OffloadConfig.deterministic_memory``).
* ``--chunk-offload-verify N``: the launcher's (``python -m chunk_offload.megatron_lm``): the job's
  first N iterations without and with offload, compared bit for bit; `attach_from_args` refuses
  it (a script of its own calls ``chunk_offload.verify_bit_identity``).
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

from ...core import OPTIONS, ChunkOffloadError, Option
from ...option_flags import argparse_keywords

__all__ = ["BUDGET_FLAGS", "DESTS", "GROUP_TITLE", "LONG_PREFIX", "MEGATRON_OFFLOAD_SWITCHES", "PLANNED_FLAGS", "add_arguments", "has_arguments"]

GROUP_TITLE = "chunk-offload"
"""Title of the argument group `add_arguments` adds."""

LONG_PREFIX = "--chunk-offload-"

FLAG_ROWS: tuple[Option, ...] = tuple(row for row in OPTIONS if row.flag)
"""The option table's rows that are launcher flags, in the order of ``--help``."""
DESTS = {row.name: row.dest for row in FLAG_ROWS}
"""Flag suffix -> destination in the parsed namespace. See NOTE [Flag names]."""
PLANNED_FLAGS = ("prefetch-bytes", "reload-ahead-bytes", "timed-reload-ahead", "device-budget")
"""Flags only the plan's policy reads (``--chunk-offload-schedule plan``)."""
BUDGET_FLAGS = ("device-budget", "host-budget", "host-pool-bytes", "prefetch-bytes", "reload-ahead-bytes")
"""Flags that bound what offload does: without --chunk-offload-modules (or with --chunk-offload-baseline) nothing uses them."""

# Megatron-LM's own activation offloading: namespace attribute -> its flag.
MEGATRON_OFFLOAD_SWITCHES = {
    "fine_grained_activation_offloading": "--fine-grained-activation-offloading",
    "cpu_offloading": "--cpu-offloading",
}


def has_arguments(parser: argparse.ArgumentParser) -> bool:
    """True when `add_arguments` already added the chunk-offload flags to ``parser``."""
    return LONG_PREFIX + "modules" in parser._option_string_actions  # argparse has no public lookup


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "chunk-offload" argument group to ``parser`` and return ``parser``: one flag per
    row of the option table (`chunk_offload.core.OPTIONS`).

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
    group = parser.add_argument_group(
        title=GROUP_TITLE,
        description=(
            "Offload what chosen submodules save for backward to pinned host memory, per pipeline chunk "
            "(chunk_offload.integrations.megatron.attach_from_args). Byte counts take an integer or a "
            "KiB/MiB/GiB/TiB suffix."
        ),
    )
    for row in FLAG_ROWS:
        group.add_argument(LONG_PREFIX + row.name, **argparse_keywords(row, keep_typed=True))
    return parser
