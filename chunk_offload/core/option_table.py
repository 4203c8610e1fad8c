"""The option table: every user-facing option once, with its kind, default, help and config field.

Each row is one option. The launcher's ``--chunk-offload-*`` flags
(`chunk_offload.integrations.megatron.add_arguments`), the planner's offload flags
(``chunk-offload plan --min-offload-bytes/--schedule``), `OffloadConfig`'s defaults and checks
and the integrations' checks of `ScheduleOptions` are all read from here, so a new option, a
changed default or a new accepted value is one edit of one row. A row's ``kind`` names both its
command-line parser (`parse_bytes`, ...) and its library check (`check_value`).
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ChunkOffloadError

__all__ = ["OPTIONS", "Option", "check_value", "config_default", "option", "parse_bytes"]

Kind = Literal["bytes", "bytes_or_none", "bytes_or_auto", "count", "choice", "switch", "switch_or_auto", "module_names", "path"]


@dataclass(frozen=True, slots=True)
class Option:
    """One option: ``--chunk-offload-<name>`` on the launcher, ``field`` in the library."""

    name: str
    """The flag's suffix (``min-offload-bytes``: ``--chunk-offload-min-offload-bytes``)."""
    kind: Kind
    """What values it takes: see `check_value`."""
    default: Any
    """The value when not given (the same on the command line and in the library)."""
    field: str | None
    """``Class.attribute`` the option sets (``OffloadConfig.min_offload_bytes``), or the keyword of
    ``attach`` (``attach.iterations``); None for what only the launcher reads."""
    help: str
    """The flag's help text (``{default}`` and, for module names, ``{names}`` are filled in)."""
    choices: tuple[str, ...] = ()
    """The accepted values of a ``choice``."""
    metavar: str | None = None
    flag: bool = True
    """False: a library-only field (no command-line flag)."""
    negated: bool = False
    """The flag sets its field to the opposite (``--chunk-offload-baseline`` sets ``offload=False``)."""
    field_values: tuple[tuple[str, Any], ...] = ()
    """A ``choice``'s value in the field where it differs (``group-start``: ``schedule_policy=None``)."""

    def to_field(self, value: Any) -> Any:
        """The field's value for the parsed flag value ``value``."""
        if self.negated:
            return not value
        return dict(self.field_values).get(value, value) if self.field_values else value

    @property
    def dest(self) -> str:
        """Attribute of the parsed namespace (NOTE [Flag names] in integrations/megatron/args.py)."""
        return "chunk_offload_" + self.name.replace("-", "_")

    @property
    def field_name(self) -> str:
        """The attribute or keyword alone (``min_offload_bytes``)."""
        return (self.field or self.dest).rpartition(".")[2]

    @property
    def owner(self) -> str | None:
        """The class or call the field belongs to (``OffloadConfig``), or None."""
        return self.field.partition(".")[0] if self.field else None


_SCHEDULES = ("plan", "group-start")

OPTIONS: tuple[Option, ...] = (
    Option(
        "modules", "module_names", None, "attach.modules",
        help=(
            "Submodules whose saved tensors are offloaded, comma- or space-separated: {names}. Unset: no "
            "offload."
        ),
        metavar="NAMES",
    ),
    Option(
        "min-offload-bytes", "bytes", 1 << 20, "OffloadConfig.min_offload_bytes",
        help=(
            "Saved tensors smaller than this stay on device (copies of small tensors cost more than they "
            "save; default: {default})."
        ),
        metavar="BYTES",
    ),
    Option(
        "host-pool-bytes", "bytes_or_none", None, "OffloadConfig.host_pool_bytes",
        help="Cap on the pinned host memory of the pool (default: no cap).",
        metavar="BYTES",
    ),
    Option(
        "on-exhausted", "choice", "fallback", "OffloadConfig.on_exhausted",
        help=(
            "At the host pool cap: 'fallback' allocates unpooled host buffers (one warning), 'error' raises "
            "(default: {default})."
        ),
        choices=("fallback", "error"),
    ),
    Option(
        "baseline", "switch", False, "OffloadConfig.offload",
        help="Track the same groups and bytes but copy nothing: the baseline run of a memory comparison.",
        negated=True,
    ),
    Option(
        "measure-time", "switch", True, "OffloadConfig.measure_time",
        help="Time copies and compute waits (CUDA events on GPU); stats report them.",
        flag=False,
    ),
    Option(
        "trace", "switch", False, "OffloadConfig.trace",
        help="Record resident saved bytes (and CUDA allocated memory) after every accounting change.",
        flag=False,
    ),
    Option(
        "deterministic-memory", "switch", False, "OffloadConfig.deterministic_memory",
        help=(
            "Compute waits on each group's copy to host before its device originals are released: device "
            "memory follows the program exactly, at the cost of stalls where the link lags (default: the copy "
            "stream releases them)."
        ),
    ),
    Option(
        "group-by", "choice", "layer", "OffloadConfig.group_by",
        help=(
            "'layer': a transformer layer's offload-module calls that follow one another form one group, copied and "
            "reloaded together, while it holds fewer bytes than layer-group-bytes: small modules share one group's "
            "host work (events, stream switches, launches), large ones keep their own; 'module': each call one group, "
            "except that a call saving a storage of the call before it in its layer joins that call's group (attn_proj "
            "saves core attention's output), so the storage is copied once; 'call': every call its own group, a "
            "storage two calls save copied twice (default: {default})."
        ),
        choices=("call", "module", "layer"),
    ),
    Option(
        "layer-group-bytes", "bytes_or_none", 16 << 20, "OffloadConfig.layer_group_bytes",
        help=(
            "Under layer groups (group-by layer) a layer's next call joins its group only while the group holds "
            "fewer bytes to copy than this (attn_proj still joins core_attn's group where it saves its output), so "
            "small modules share their per-group host work while large ones keep their own groups; 'none': the "
            "whole layer (default: {default})."
        ),
        metavar="BYTES",
    ),
    Option(
        "group-slab-bytes", "bytes", 32 << 20, "OffloadConfig.group_slab_bytes",
        help=(
            "A group of several saved storages that fit in this many bytes shares one pinned host buffer and "
            "comes back in one device buffer with one copy, which cuts the per-tensor host work of small "
            "groups; 0: a buffer and a copy per storage (default: {default})."
        ),
        metavar="BYTES",
    ),
    Option(
        "profile-ranges", "switch", False, "OffloadConfig.profile_ranges",
        help=(
            "Name each group's offload, reload and waits in torch.profiler traces (NVTX ranges under nsys on "
            "CUDA)."
        ),
    ),
    Option(
        "schedule", "choice", "plan", "ScheduleOptions.schedule_policy",
        help=(
            "'plan' (default): decisions from the pipeline schedule's table: chunks whose backward follows at "
            "once stay on device, and the next backward chunk is reloaded during the action before it. "
            "'group-start': offload every chunk and reload each group when backward reaches the group after "
            "it."
        ),
        choices=_SCHEDULES,
        field_values=(("group-start", None),),
    ),
    Option(
        "prefetch-bytes", "bytes_or_none", None, "ScheduleOptions.prefetch_bytes",
        help=(
            "With --chunk-offload-schedule plan: bytes of a chunk reloaded ahead of its backward (default: "
            "its last group; 0: none)."
        ),
        metavar="BYTES",
    ),
    Option(
        "reload-ahead-bytes", "bytes_or_none", None, "ScheduleOptions.reload_ahead_bytes",
        help=(
            "With --chunk-offload-schedule plan: in a chunk's backward, bytes of earlier groups that may be "
            "reloading ahead of the running one (default: one group ahead). Hides a large group's copy behind "
            "small groups."
        ),
        metavar="BYTES",
    ),
    Option(
        "timed-reload-ahead", "switch_or_auto", "auto", "ScheduleOptions.timed_reload_ahead",
        help=(
            "With --chunk-offload-schedule plan and no --chunk-offload-reload-ahead-bytes: set each chunk's "
            "reload-ahead bytes from the previous iteration's measured reload rate and backward time, the fewest "
            "under which its reloads are predicted to wait least (with --chunk-offload-device-budget, only where the "
            "predicted peak stays within it). Peak memory then follows each run's timing. 'auto' (the default): on "
            "where copies run on a device's copy engines (CUDA), off on CPU streams, whose copy times are the host's "
            "thread scheduling; the flag alone means 'on'."
        ),
        choices=("auto", "on", "off"),
        field_values=(("on", True), ("off", False)),
    ),
    Option(
        "device-budget", "bytes_or_auto", None, "ScheduleOptions.device_budget_bytes",
        help=(
            "With --chunk-offload-schedule plan: device bytes this rank may use; each rank offloads the "
            "fewest groups whose predicted peak fits (a rank that fits offloads nothing). CUDA: bounds "
            "max_memory_allocated; CPU: the saved-bytes accounting. 'auto': the smallest budget every "
            "pipeline rank meets. Default: no budget."
        ),
        metavar="BYTES|auto",
    ),
    Option(
        "host-budget", "bytes_or_none", None, "ScheduleOptions.host_budget_bytes",
        help=(
            "Pinned host bytes of the whole node, split among its ranks by what each rank's plan puts on host "
            "(early stages get more); each rank's host pool cap follows after the first iteration. Default: "
            "no budget."
        ),
        metavar="BYTES",
    ),
    Option(
        "iterations", "choice", "wrap", "attach.iterations",
        help=(
            "'wrap' (default): each call of manager.wrap(get_forward_backward_func()) is one offload "
            "iteration. 'auto': the manager opens an iteration at the first training forward of each step and "
            "closes it when every model chunk ran get_num_microbatches() forwards and their backwards; for "
            "training loops that call get_forward_backward_func() themselves (Megatron-LM's pretrain)."
        ),
        choices=("wrap", "auto"),
    ),
    Option(
        "report", "path", None, None,
        help=(
            "Produce the per-stage memory report (peak without and with offload, theoretical drop, R): the "
            "first training iteration runs as a baseline without copies, and the per-stage memory report "
            "will be written to PATH.json, PATH.png and PATH.md by the training loop "
            "(chunk_offload.report.write_report)."
        ),
        metavar="PATH",
    ),
    Option(
        "verify", "count", None, None,
        help=(
            "Launcher only: run the job's first N training iterations twice from the same seed, without "
            "chunk-offload and with it, compare every loss, gradient and parameter bit for bit, and print PASS "
            "or the first mismatch (exit status 1 on a mismatch). Library: chunk_offload.verify_bit_identity."
        ),
        metavar="N",
    ),
    Option(
        "plan", "path", None, None,
        help=(
            "Launcher only: 'auto' chooses per stage which modules to offload and, for the whole model, which to "
            "recompute (Megatron's --recompute-granularity selective --recompute-modules), so that every stage fits "
            "--chunk-offload-device-budget BYTES at the least predicted extra time; or a FILE written by "
            "chunk-offload plan ... --co-plan --json FILE. Applied before the model is built; replaces "
            "--chunk-offload-modules."
        ),
        metavar="auto|FILE",
    ),
)
"""Every option, in the order the launcher lists its flags."""

_BY_NAME = {row.name: row for row in OPTIONS}
_BY_FIELD = {row.field: row for row in OPTIONS if row.field}


def option(name: str) -> Option:
    """The row of flag suffix ``name`` (``"min-offload-bytes"``) or of field ``Class.attribute``."""
    row = _BY_NAME.get(name) or _BY_FIELD.get(name)
    if row is None:
        raise KeyError(f"no option {name!r}; options: {sorted(_BY_NAME)}")
    return row


def config_default(field: str) -> Any:
    """The default of ``Class.attribute`` (for the dataclasses whose fields the table lists)."""
    return option(field).default


_BYTES_TEXT = {
    "bytes": "an int number of bytes >= 0",
    "bytes_or_none": "an int number of bytes >= 0 or None",
    "bytes_or_auto": "an int number of bytes >= 0, 'auto' (the smallest budget every pipeline rank meets) or None",
}


def check_value(row: Option, value: Any, *, name: str | None = None) -> Any:
    """``value`` if ``row`` accepts it, else `ChunkOffloadError` naming ``name`` (default the
    field's name), the value and what is accepted.

    Kinds: ``bytes`` an int >= 0 (bool, float, nan and inf refused), ``bytes_or_none`` also None,
    ``bytes_or_auto`` also None and ``"auto"``; ``count`` an int >= 1 (bool refused) or None;
    ``choice`` one of ``row.choices``; ``switch`` True or False; ``switch_or_auto`` True, False or
    ``"auto"`` (on the command line ``on``, ``off`` or ``auto``); ``path`` a str or None;
    ``module_names`` is checked by `chunk_offload.module_names`.
    """
    label = name or row.field_name
    kind = row.kind
    if kind in _BYTES_TEXT:
        if value is None and kind != "bytes":
            return None
        if kind == "bytes_or_auto" and isinstance(value, str) and value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            accepted = _BYTES_TEXT[kind]
            if isinstance(value, float) and not math.isfinite(value):
                accepted += " (not nan or inf)"
            raise ChunkOffloadError(f"{label} must be {accepted}, got {value!r}; pass e.g. 64 << 30 for 64 GiB")
        return int(value)
    if kind == "count":
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
            raise ChunkOffloadError(f"{label} must be an int count >= 1 or None, got {value!r}")
        return None if value is None else int(value)
    if kind == "choice":
        if not isinstance(value, str) or value not in row.choices:
            raise ChunkOffloadError(f"{label}={value!r} is not valid; choose one of {row.choices}")
        return value
    if kind == "switch_or_auto":
        if not (isinstance(value, bool) or (isinstance(value, str) and value == "auto")):
            raise ChunkOffloadError(f"{label} must be True, False or 'auto', got {value!r}")
        return value
    if kind == "switch":
        if not isinstance(value, bool):
            raise ChunkOffloadError(f"{label} must be True or False, got {value!r}")
        return value
    if kind == "path":
        if value is not None and not isinstance(value, str):
            raise ChunkOffloadError(f"{label} must be a path (str) or None, got {value!r}")
        return value
    return value


_SIZE_UNITS = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """A byte count >= 0 from the command line: an integer with an optional binary suffix
    (``512KiB``, ``1MiB``, ``64GiB``); `ValueError` otherwise (argparse reports it as a usage error)."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"expected a byte count >= 0 such as 1048576 or 1MiB (suffixes KiB, MiB, GiB, TiB), got {text!r}")
    return int(match.group(1)) * _SIZE_UNITS[unit]
