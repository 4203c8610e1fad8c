"""`run_script` and the command line of ``python -m chunk_offload.megatron_lm SCRIPT [ARGS...]``."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import runpy
import sys
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..core.errors import ChunkOffloadError
from .entry_points import EntryPoints

__all__ = ["main", "run_script"]

_DESCRIPTION = (
    "Run an unmodified Megatron-LM training script (pretrain_gpt.py of core_v0.16 or core_v0.19, or "
    "one in the same style) with chunk-offload: the script's own arguments plus the --chunk-offload-* "
    "flags (e.g. --chunk-offload-modules core_attn,qkv_linear --chunk-offload-report out/report). "
    "Iterations are delimited automatically. Without CUDA, megatron-core and megatron.training run on "
    "CPU with gloo (pass --distributed-backend gloo)."
)


@contextlib.contextmanager
def _cpu_layers() -> Iterator[None]:
    """megatron-core's and megatron.training's CPU rules, when this host has no CUDA; else nothing."""
    if torch.cuda.is_available():
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


def run_script(script: str | os.PathLike, script_args: Sequence[str]) -> EntryPoints:
    """Run ``script`` as ``__main__`` with ``script_args``, Megatron-LM's entry points wrapped.

    Returns the `EntryPoints` of the run (its ``manager`` and ``report_files``). The wraps, the
    CPU rules, ``sys.argv`` and ``sys.path`` are restored afterwards, also when the script raises.
    """
    script = Path(script)
    # NOTE: sys.path first: a Megatron-LM checkout (core_v0.16) brings megatron.training with it.
    with _as_main_argv(script, script_args):
        _require_megatron_training(script)
        with _cpu_layers(), EntryPoints() as entry_points:
            runpy.run_path(str(script), run_name="__main__")
    return entry_points


def _require_megatron_training(script: Path) -> None:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.training") is None:
        raise ChunkOffloadError(
            f"chunk_offload: the launcher needs Megatron-LM's megatron.training to run {str(script)!r}; it is "
            "neither next to the script (a Megatron-LM checkout) nor installed (megatron-core >= 0.19 ships it)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m chunk_offload.megatron_lm``; exit code 2 on a usage error."""
    parser = argparse.ArgumentParser(
        prog="python -m chunk_offload.megatron_lm", description=_DESCRIPTION, allow_abbrev=False
    )
    parser.add_argument("script", help="the Megatron-LM training script, e.g. pretrain_gpt.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments, ours included")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not Path(args.script).is_file():
        parser.error(f"script {args.script!r} is not a file; pass the path of a training script such as pretrain_gpt.py")
    try:
        run_script(args.script, args.script_args)
    except ChunkOffloadError as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")  # a run-time error, not a usage error: exit 1
    return 0
