"""Loading a `bench/` script as a module, the one way the tests do it."""

from __future__ import annotations

import importlib.util
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
