"""The command line ``python -m chunk_offload.megatron_lm SCRIPT [ARGS...]`` around `run.run_script`.

Exit status: 2 for a usage error, found before anything runs (`preflight`); 1 when the run cannot
start or fails at its end; with ``--chunk-offload-verify N``, 1 on a mismatch; 0 otherwise (see
`run`). What the launcher's modules log is printed here, as the command line's own output.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path
from typing import Iterator, Sequence

from ..core.errors import ChunkOffloadError
from .closing import Closing
from .preflight import USAGE, LauncherParser, preflight
from .run import run_script
from .verify import die_with_parent, run_verify

__all__ = ["main"]

_DESCRIPTION = (
    "Run an unmodified Megatron-LM training script (pretrain_gpt.py of core_v0.16 or core_v0.19, or "
    "one in the same style) with chunk-offload: the script's own arguments plus the --chunk-offload-* "
    "flags (e.g. --chunk-offload-modules core_attn,qkv_linear --chunk-offload-report out/report). "
    "Iterations are delimited automatically. Without CUDA, megatron-core and megatron.training run on "
    "CPU with gloo (pass --distributed-backend gloo). At the end rank 0 prints a summary per rank. "
    "--chunk-offload-verify N runs the job's first N iterations without and with offload instead and "
    "compares losses, gradients and parameters bit for bit (exit status 1 on a mismatch)."
)



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
