"""Loading a `bench/` script as a module, or running it as a user does: the one way each the tests do it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench_script(name: str) -> ModuleType:
    """``bench/<name>.py`` as a fresh module (its own imports of the benches' shared helpers
    resolve: the scripts put their folder on ``sys.path``), registered in ``sys.modules`` under
    ``name`` as an import would (dataclasses and pickling look a class's module up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_bench_script(name: str, *args: str, timeout: float = 300, path: str | None = None) -> subprocess.CompletedProcess:
    """``python bench/<name>.py args...`` as a user runs it, on the CPU (CUDA hidden, one OpenMP
    thread), this checkout first on the import path; ``path``: the ``PATH`` it sees (default ours)."""
    root = str(BENCH.parent)
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": pythonpath}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args], capture_output=True, text=True, timeout=timeout, env=env)
