"""Megatron's dataset helpers (``megatron/core/datasets/helpers.cpp``): compiled, or built by Megatron's own ``make``.

Every GPT dataset, mock data included, builds its sample index with
``megatron.core.datasets.helpers.build_sample_idx``, a pybind11 module (``helpers_cpp``); megatron
has no pure-Python version. Megatron-LM's ``initialize_megatron`` calls
``megatron.core.datasets.utils.compile_helpers`` on rank 0, which runs ``make -C`` in that folder
and exits the process if it fails. Where ``megatron.core`` comes from decides what is there:

* the megatron-core wheel ships ``helpers_cpp`` compiled and no ``Makefile`` (``make`` there fails
  with "no makefile found");
* a Megatron-LM checkout (its folder first on ``sys.path``, so its ``megatron.core`` is the one
  imported) has ``helpers.cpp`` and the ``Makefile``, and nothing compiled until it is built. The
  Makefile runs ``$(CXX)`` (``g++`` unless ``CXX`` is set), ``python3 -m pybind11 --includes``
  and ``python3-config --extension-suffix``: the ``python3`` on ``PATH`` needs pybind11 and its
  headers, and its extension suffix must be the running Python's, or the module built is never
  imported.

`compiled_or_built` (applied by `compiled_first`, or as a rule of
`chunk_offload.devkit.megatron_training_cpu`) makes ``compile_helpers`` import the compiled module when it imports and run
Megatron's ``make`` only otherwise, with the running Python's folder first on ``PATH`` (so that a
virtual environment's ``python3`` is the one the Makefile runs). `check_helpers` says before any
work what a build would lack (`missing_build_tools`). Used by
`chunk_offload.devkit.megatron_training_cpu` and by the ``chunk_offload.megatron_lm`` launcher.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from ..core.errors import ChunkOffloadError

__all__ = ["HELPERS_MODULE", "HelpersFolder", "check_helpers", "compiled_first", "compiled_or_built", "locate", "missing_build_tools"]

HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"
"""The compiled module ``compile_helpers`` builds."""


@dataclass(frozen=True, slots=True)
class HelpersFolder:
    """The ``megatron/core/datasets`` folder that ``import megatron.core`` would use."""

    path: Path
    compiled: Path | None
    """The compiled ``helpers_cpp`` this Python imports (None: not built)."""
    makefile: bool
    """Whether Megatron's ``Makefile`` is there (a Megatron-LM checkout)."""


def locate() -> HelpersFolder | None:
    """The datasets folder of the ``megatron.core`` on ``sys.path`` (found, not imported); None without one."""
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "datasets"
    compiled = next((folder / f"helpers_cpp{s}" for s in importlib.machinery.EXTENSION_SUFFIXES if (folder / f"helpers_cpp{s}").is_file()), None)
    return HelpersFolder(path=folder, compiled=compiled, makefile=(folder / "Makefile").is_file())


def _search_path(environ: Mapping[str, str]) -> str:
    """``PATH`` as the build sees it: the running Python's folder first (see `compiled_or_built`)."""
    return os.pathsep.join([str(Path(sys.executable).parent), environ.get("PATH", "")])


def missing_build_tools(environ: Mapping[str, str] | None = None) -> list[str]:
    """What Megatron's ``Makefile`` needs and this host lacks, one entry each, with how to get it."""
    environ = os.environ if environ is None else environ
    path = _search_path(environ)
    missing = []
    if shutil.which("make", path=path) is None:
        missing.append("make (e.g. apt install make)")
    compiler = (environ.get("CXX") or "g++").split()[0]
    if shutil.which(compiler, path=path) is None:
        missing.append(f"a C++ compiler: {compiler!r} is not on PATH (make runs $(CXX), g++ unless CXX is set; e.g. apt install g++)")
    python3 = shutil.which("python3", path=path)
    if python3 is None:
        return [*missing, "python3 on PATH with pybind11 (the Makefile runs python3 -m pybind11 --includes)"]
    includes = _output([python3, "-m", "pybind11", "--includes"])
    if includes is None:
        missing.append(f"pybind11 for {python3} (pip install pybind11 into that Python)")
    elif not any((Path(flag[2:]) / "Python.h").is_file() for flag in includes.split() if flag.startswith("-I")):
        missing.append(f"the Python headers (Python.h) of {python3} (e.g. apt install python3-dev)")
    config = shutil.which("python3-config", path=path)
    suffix = _output([config, "--extension-suffix"]) if config is not None else None
    wanted = sysconfig.get_config_var("EXT_SUFFIX")
    if suffix is None:
        missing.append("python3-config on PATH (the Python development files, e.g. apt install python3-dev)")
    elif suffix.strip() != wanted:
        missing.append(
            f"python3-config of this Python: {config} names the extension suffix {suffix.strip()!r}, this Python "
            f"({sys.executable}) imports {wanted!r}; put the matching python3-config first on PATH"
        )
    return missing


def _output(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def check_helpers(folder: HelpersFolder | None = None, environ: Mapping[str, str] | None = None) -> None:
    """Raise `ChunkOffloadError` when the dataset helpers are neither compiled nor buildable here.

    ``folder``: `locate`'s (None: located now; nothing to check without megatron.core).
    """
    folder = locate() if folder is None else folder
    if folder is None or folder.compiled is not None:
        return
    if not folder.makefile:
        raise ChunkOffloadError(
            f"chunk_offload: {folder.path} has neither the compiled dataset helpers (helpers_cpp) nor Megatron's Makefile to "
            "build them; reinstall megatron-core (its wheel ships them compiled) or run from a complete Megatron-LM checkout"
        )
    missing = missing_build_tools(environ)
    if missing:
        raise ChunkOffloadError(
            f"chunk_offload: Megatron-LM builds its dataset helpers (helpers.cpp, used by every dataset, mock data included) "
            f"with make in {folder.path} at start-up, and this host lacks: {'; '.join(missing)}. Install them, or run "
            f"make -C {folder.path} once yourself where they are installed"
        )


@contextlib.contextmanager
def _python_first_on_path() -> Iterator[None]:
    previous = os.environ.get("PATH")
    os.environ["PATH"] = _search_path(os.environ)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = previous


def compiled_or_built(compile_helpers: Callable[[], Any]) -> Callable[[], None]:
    """``compile_helpers`` that imports the compiled helpers when they import, and else checks the
    build tools (`check_helpers`) and runs Megatron's own ``compile_helpers`` (``make``)."""

    @functools.wraps(compile_helpers)
    def compiled_or_make() -> None:
        try:
            importlib.import_module(HELPERS_MODULE)
            return
        except ImportError:
            pass
        folder = locate()
        if folder is not None and folder.compiled is not None:  # built, yet it does not import
            raise ChunkOffloadError(
                f"chunk_offload: {folder.compiled} is there but {HELPERS_MODULE} does not import; delete it and run "
                f"make -C {folder.path} to rebuild it for this Python ({sys.executable})"
            )
        if folder is not None:
            check_helpers(folder)
        with _python_first_on_path():
            compile_helpers()
        importlib.invalidate_caches()

    return compiled_or_make


@contextlib.contextmanager
def compiled_first() -> Iterator[None]:
    """``megatron.core.datasets.utils.compile_helpers`` as `compiled_or_built` while the block runs
    (with CUDA too: on a GPU host Megatron-LM runs ``make`` in the wheel as well)."""
    utils = importlib.import_module("megatron.core.datasets.utils")
    original = utils.compile_helpers
    utils.compile_helpers = compiled_or_built(original)
    try:
        yield
    finally:
        utils.compile_helpers = original
