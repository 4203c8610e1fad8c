"""`run_script` and the command line of ``python -m chunk_offload.megatron_lm SCRIPT [ARGS...]``.

Exit status: 2 for a usage error, found before anything runs (`preflight`); 1 when the run cannot
start (no ``megatron.training``, dataset helpers that cannot be built) or fails at its end (the
report cannot be written: the summary is printed first); 0 otherwise. With
``--chunk-offload-verify N`` (`verify.run_verify`): 0 when the runs without and with offload are
bit-identical, 1 on a mismatch or when a run fails.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import os
import runpy
import sys
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..core.errors import ChunkOffloadError
from ..devkit import megatron_dataset_helpers
from .closing import Closing
from .entry_points import EntryPoints
from .preflight import USAGE, LauncherParser, preflight
from .recording import Recorder
from .verify import die_with_parent, run_verify

__all__ = ["main", "run_script"]

_DESCRIPTION = (
    "Run an unmodified Megatron-LM training script (pretrain_gpt.py of core_v0.16 or core_v0.19, or "
    "one in the same style) with chunk-offload: the script's own arguments plus the --chunk-offload-* "
    "flags (e.g. --chunk-offload-modules core_attn,qkv_linear --chunk-offload-report out/report). "
    "Iterations are delimited automatically. Without CUDA, megatron-core and megatron.training run on "
    "CPU with gloo (pass --distributed-backend gloo). At the end rank 0 prints a summary per rank. "
    "--chunk-offload-verify N runs the job's first N iterations without and with offload instead and "
    "compares losses, gradients and parameters bit for bit (exit status 1 on a mismatch)."
)


@contextlib.contextmanager
def _megatron_layers() -> Iterator[None]:
    """Megatron's dataset helpers imported before built; without CUDA also megatron-core's and
    megatron.training's CPU rules (whose ``compile_helpers`` rule does the same)."""
    if torch.cuda.is_available():
        with megatron_dataset_helpers.compiled_first():
            yield
        return
    from ..devkit import cpu_compat, megatron_training_cpu

    with cpu_compat.megatron_on_cpu(), megatron_training_cpu.training_on_cpu():
        yield


@contextlib.contextmanager
def _as_main_argv(script: Path, script_args: Sequence[str]) -> Iterator[None]:
    """``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS...`` would set them, restored after."""
    argv, path = sys.argv[:], sys.path[:]
    sys.argv = [str(script), *script_args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        yield
    finally:
        sys.argv[:] = argv
        sys.path[:] = path


def run_script(
    script: str | os.PathLike, script_args: Sequence[str], *, record: tuple[str | os.PathLike, int] | None = None
) -> EntryPoints:
    """Run ``script`` as ``__main__`` with ``script_args``, Megatron-LM's entry points wrapped.

    Returns the `EntryPoints` of the run (its ``manager``, ``report_files`` and ``closing``). The
    wraps, the CPU rules, ``sys.argv`` and ``sys.path`` are restored afterwards, also when the
    script raises. ``record=(folder, n)``: a child run of ``--chunk-offload-verify n``, which
    records n training iterations into ``folder`` and ends there (NOTE [Verify runs] in
    ``verify.py``). Raises `ChunkOffloadError` before the script runs when megatron.training is
    missing or Megatron's dataset helpers are neither compiled nor buildable here.
    """
    script = Path(script)
    # NOTE: sys.path first: a Megatron-LM checkout brings megatron.core and megatron.training with it.
    with _as_main_argv(script, script_args):
        _find_megatron_training(script)
        megatron_dataset_helpers.check_helpers()
        with _megatron_layers():  # megatron.training imported under megatron-core's CPU rules, as before
            _import_megatron_training()
            with EntryPoints(summary_on_exit=record is not None) as entry_points:
                if record is None:
                    runpy.run_path(str(script), run_name="__main__")
                    return entry_points
                with Recorder(record[0], record[1], lambda: entry_points.manager):
                    try:
                        runpy.run_path(str(script), run_name="__main__")
                    except SystemExit as e:  # the Recorder's end of training
                        if e.code not in (0, None):
                            raise
    return entry_points


def _find_megatron_training(script: Path) -> None:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.training") is None:
        raise ChunkOffloadError(
            f"chunk_offload: the launcher needs Megatron-LM's megatron.training to run {str(script)!r}; it is "
            "neither next to the script (a Megatron-LM checkout) nor installed (megatron-core >= 0.19 ships it)"
        )


def _import_megatron_training() -> None:
    """megatron.training must import: it needs triton (also on CPU), and a checkout its requirements."""
    try:
        importlib.import_module("megatron.training")
    except ModuleNotFoundError as e:
        origin = importlib.util.find_spec("megatron.training").origin
        raise ChunkOffloadError(
            f"chunk_offload: Megatron-LM's megatron.training ({origin}) does not import: {e}; install it "
            f"(pip install {(e.name or '?').split('.')[0]}; megatron.training imports triton even on CPU, and a "
            "Megatron-LM checkout needs the packages of its requirements files)"
        ) from e


def _close(closing: Closing | None, prog: str) -> int:
    """Print the closing (rank 0 has one) and return the exit status."""
    if closing is None:
        return 0
    if closing.summary:
        print(closing.summary, flush=True)
    for warning in closing.warnings:
        print(f"{prog}: warning: {warning}", file=sys.stderr, flush=True)
    if closing.error is not None:
        print(f"{prog}: error: {closing.error}", file=sys.stderr, flush=True)
        return 1
    return 0


@contextlib.contextmanager
def _console() -> Iterator[None]:
    """What the launcher's modules log (``chunk_offload.megatron_lm.*``), printed as the command
    line's own output: INFO lines on stdout, warnings and errors on stderr, the message alone."""
    package = logging.getLogger(__package__)
    out, err = logging.StreamHandler(sys.stdout), logging.StreamHandler(sys.stderr)
    out.addFilter(lambda record: record.levelno < logging.WARNING)
    err.setLevel(logging.WARNING)
    saved = package.level, package.propagate
    package.setLevel(logging.INFO)
    package.propagate = False
    for handler in (out, err):
        handler.setFormatter(logging.Formatter("%(message)s"))
        package.addHandler(handler)
    try:
        yield
    finally:
        for handler in (out, err):
            package.removeHandler(handler)
        package.setLevel(saved[0])
        package.propagate = saved[1]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m chunk_offload.megatron_lm``; exit status 2 on a usage error."""
    with _console():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = LauncherParser(prog="python -m chunk_offload.megatron_lm", usage=USAGE, description=_DESCRIPTION, allow_abbrev=False)
    parser.add_argument("--verify-record", metavar="DIR", help=argparse.SUPPRESS)  # a child run of --chunk-offload-verify
    parser.add_argument("--verify-iterations", metavar="N", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("script", help="the Megatron-LM training script, e.g. pretrain_gpt.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments, ours included")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not Path(args.script).is_file():
        parser.error(f"script {args.script!r} is not a file; pass the path of a training script such as pretrain_gpt.py")
    ours = preflight(args.script_args, prog=parser.prog)
    if ours.chunk_offload_verify is not None:
        return run_verify(args.script, args.script_args, ours.chunk_offload_verify, prog=parser.prog)
    record = None
    if args.verify_record:
        die_with_parent()
        record = (args.verify_record, args.verify_iterations)
    try:
        entry_points = run_script(args.script, args.script_args, record=record)
    except ChunkOffloadError as e:  # a run-time error, not a usage error: exit 1, on every rank
        print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        return 1
    return _close(entry_points.closing, parser.prog)
