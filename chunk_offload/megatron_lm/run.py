"""`run_script`: an unmodified Megatron-LM training script run with Megatron-LM's entry points
wrapped; the command line around it is `cli.py`.

Exit status of that command line: 2 for a usage error, found before anything runs (`preflight`); 1 when the run cannot
start (no ``megatron.training``, dataset helpers that cannot be built) or fails at its end (the
report cannot be written: the summary is printed first); 0 otherwise. With
``--chunk-offload-verify N`` (`verify.run_verify`): 0 when the runs without and with offload are
bit-identical, 1 on a mismatch or when a run fails.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import runpy
import sys
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..core.errors import ChunkOffloadError
from ..devkit import megatron_dataset_helpers
from .entry_points import EntryPoints
from .recording import Recorder

__all__ = ["run_script"]

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
